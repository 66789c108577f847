"""What a model-runner step hands back: sampled tokens, read back from the device on demand.

``ModelRunner.execute_async`` launches a step and returns a ``PendingOutput`` at once; its
``result()`` waits for the step's device work, records the emitted tokens in the runner's
request states and builds the ``RunnerOutput``. Between the two the host is free to prepare
the next step while the device computes this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hitchllm.engine.input_batch import RequestState
from hitchllm.engine.prompt_logprobs import PromptLogprobs
from hitchllm.engine.sampler import LogprobsTensors
from hitchllm.kv_transfer.connector import KVTransferEvents
from hitchllm.logits_processor import host_to_device
from hitchllm.outputs import Logprob


@dataclass
class RunnerOutput:
    """Tokens emitted per request id this step (more than one when drafts were accepted),
    and, when asked, one logprobs entry per emitted token.

    ``hidden_states`` (only when the runner keeps them) has one row per entry of ``sampled``,
    in its order: the model's final hidden state at the position that produced the request's
    last emitted token, on the device.
    """

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    hidden_states: torch.Tensor | None = None
    # The runner's KV connector's news this step (None without a connector).
    kv_events: KVTransferEvents | None = None


class PendingOutput:
    """A launched step's output, still on the device (or already complete).

    ``requests`` lists the logits rows: ``(request, drafts)`` per sampling request, the request
    owning ``len(drafts) + 1`` consecutive rows of ``sampled_host``. ``sampled_host`` is a
    pinned host tensor filled by a non-blocking copy that ``ready`` marks complete.
    ``hidden_states``, when kept, holds the final hidden state of every logits row.
    """

    def __init__(
        self,
        requests: list[tuple[RequestState, list[int]]] | None = None,
        sampled_host: torch.Tensor | None = None,
        ready: torch.cuda.Event | None = None,
        logprobs: LogprobsTensors | None = None,
        prompt_logprobs: dict[str, PromptLogprobs] | None = None,
    ) -> None:
        self.requests = requests or []
        self.sampled_host = sampled_host
        self.ready = ready
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs or {}
        self.hidden_states: torch.Tensor | None = None
        self.kv_events: KVTransferEvents | None = None
        self._result: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        """Wait for the step's tokens and fold drafts: a request's tokens are its sampled
        rows up to and including the first one that differs from its draft. The first call
        appends them to the runner's request states; later calls return the same output."""
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> RunnerOutput:
        out = RunnerOutput(prompt_logprobs=self.prompt_logprobs, kv_events=self.kv_events)
        if self.sampled_host is None:
            return out
        if self.ready is not None:
            self.ready.synchronize()
        sampled = self.sampled_host.tolist()
        if len(sampled) == len(self.requests) and self.logprobs is None:
            # No drafts (one row per request) and no logprobs: every step of plain decoding.
            for (r, _), token in zip(self.requests, sampled):
                out.sampled[r.request_id] = [token]
                r.output_token_ids.append(token)
            out.hidden_states = self.hidden_states
            return out
        entries = self._logprob_entries() if self.logprobs is not None else None
        last_rows = []
        i = 0
        for r, drafts in self.requests:
            tokens = []
            for j in range(len(drafts) + 1):
                tokens.append(sampled[i + j])
                if j == len(drafts) or sampled[i + j] != drafts[j]:
                    break
            out.sampled[r.request_id] = tokens
            r.append_tokens(tokens)
            last_rows.append(i + len(tokens) - 1)
            if entries is not None and r.sampling_params.logprobs is not None:
                out.logprobs[r.request_id] = entries[i : i + len(tokens)]
            i += len(drafts) + 1
        if self.hidden_states is not None:
            out.hidden_states = self.hidden_states
            if len(last_rows) < i:  # drafts: one of each request's rows
                rows = torch.tensor(last_rows, dtype=torch.int64)
                out.hidden_states = self.hidden_states[
                    host_to_device(rows, self.hidden_states.device)]
        return out

    def _logprob_entries(self) -> list[dict[int, Logprob]]:
        assert self.logprobs is not None
        ids = self.logprobs.token_ids.tolist()
        lps = self.logprobs.logprobs.tolist()
        ranks = self.logprobs.ranks.tolist()
        entries = []
        i = 0
        for r, drafts in self.requests:
            k = r.sampling_params.logprobs or 0
            for _ in range(len(drafts) + 1):
                entry = {ids[i][0]: Logprob(lps[i][0], ranks[i])}
                for j in range(1, k + 1):
                    entry.setdefault(ids[i][j], Logprob(lps[i][j], j))
                entries.append(entry)
                i += 1
        return entries
