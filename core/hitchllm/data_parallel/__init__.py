"""Data-parallel serving: N engine replicas behind one OpenAI-compatible server.

What runs where:

- the server process runs the HTTP server, tokenizes prompts and holds a
  ``DataParallelEngine`` (``client.py``), which routes each request to a replica with a
  ``LoadBalancer`` (``balancer.py``) and merges the replicas' metrics (``metrics.py``);
- each replica is a process of its own (``replica.py``, started with ``spawn``) running a whole
  engine (``LLMEngine`` in an ``AsyncLLMEngine``) on its own devices; the two talk over a
  ``multiprocessing`` pipe with the messages of ``messages.py``.

This package imports nothing heavy at module level: a replica process imports ``replica.py``
before it has chosen its devices and CPU threads.
"""
