"""Data-parallel serving: N engine replicas behind one OpenAI-compatible server.

What runs where:

- the server process runs the HTTP server, tokenizes prompts and holds a
  ``DataParallelEngine`` (``client.py``), which routes each request to a replica with a
  ``LoadBalancer`` (``balancer.py``), talks to each through a ``ReplicaHandle``
  (``handle.py``) and merges the replicas' metrics (``metrics.py``);
- each replica is a process of its own (``replica.py``, started with ``spawn`` in the
  environment ``placement.py`` gives it: its GPUs or CPU threads) running a whole engine
  (``LLMEngine`` in an ``AsyncLLMEngine``); the two talk over a ``multiprocessing`` pipe with
  the messages of ``messages.py``, outputs as deltas (``deltas.py``).

This package imports nothing heavy at module level: a replica process imports ``replica.py``
before it has chosen its devices and CPU threads.
"""
