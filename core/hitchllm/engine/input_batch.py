"""The model runner's own per-request state, and persistent host-side rows of token ids and
block tables.

The runner learns of a request from the step plan (``NewRequestData``), then advances the
request's state itself: tokens from its own sampling (``RequestState.append_tokens``), blocks
from each plan's ``new_block_ids``. Each running request owns a row; between steps only what
changed is copied in (``sync_rows``: the decode rows' new tokens in one assignment), so
building a step's flat tensors is a handful of vectorized numpy gathers instead of per-token
Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hitchllm.logits_processor import LogitsProcessor
from hitchllm.sampling_params import SamplingParams
from hitchllm.scheduler.step_plan import NewRequestData


@dataclass(eq=False)
class RequestState:
    """What the runner knows of one running request. ``output_token_ids`` are the tokens
    whose sampling has completed on the host's side; a token still being sampled on the
    device is not in it yet."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    output_token_ids: list[int]
    lora_request: Any
    row: int
    # The logits processors this request uses (those of the runner that say so).
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    # Tokens copied into the row's token ids, and block ids into its block table.
    num_synced_tokens: int = 0
    num_blocks: int = 0

    @property
    def lora_name(self) -> str | None:
        return getattr(self.lora_request, "lora_name", None)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_tokens(self, token_ids: list[int]) -> None:
        """Record tokens the runner sampled for this request (called when a step's output is
        read back)."""
        self.output_token_ids.extend(token_ids)


class InputBatch:
    """Per-request states, and rows of token ids ``[max_num_reqs, max_model_len]`` and block
    ids per request."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.states: dict[str, RequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, new: NewRequestData, processors: list[LogitsProcessor]) -> RequestState:
        """Give a request new to the runner its state and a row."""
        if new.request_id in self.states:
            raise RuntimeError(f"request {new.request_id!r} is already in the input batch")
        if not self._free_rows:
            raise RuntimeError("more running requests than max_num_seqs rows")
        state = RequestState(
            new.request_id, list(new.prompt_token_ids), new.sampling_params,
            new.eos_token_ids, list(new.output_token_ids), new.lora_request,
            row=self._free_rows.pop(), logits_processors=processors,
        )
        self.states[new.request_id] = state
        return state

    def release(self, request_id: str) -> None:
        """Drop a request's state and give its row back (it finished or was preempted); a
        request the runner never ran is ignored."""
        state = self.states.pop(request_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def sync_rows(
        self, request_ids: list[str], new_block_ids: list[list[int]],
        draft_token_ids: dict[str, list[int]],
    ) -> tuple[list[RequestState], list[list[int]], np.ndarray, np.ndarray]:
        """Bring the rows of one step's requests up to date (``sync`` of each): their states,
        drafts, rows, and the tokens of each the host knows (drafts included).

        One pass over the requests: the common decode row (one token sampled since its last
        step, no new block) only adds that token to a list, and the tokens of all such rows
        are written with one assignment."""
        states = [self.states[rid] for rid in request_ids]
        no_drafts: list[int] = []
        drafts = ([draft_token_ids.get(rid, no_drafts) for rid in request_ids]
                  if draft_token_ids else [no_drafts] * len(states))
        rows: list[int] = []
        known: list[int] = []
        new_rows: list[int] = []
        new_cols: list[int] = []
        new_tokens: list[int] = []
        for state, blocks, row_drafts in zip(states, new_block_ids, drafts, strict=True):
            output = state.output_token_ids
            end = len(state.prompt_token_ids) + len(output)
            if (not blocks and not row_drafts and end == state.num_synced_tokens + 1
                    and output):
                new_rows.append(state.row)
                new_cols.append(end - 1)
                new_tokens.append(output[-1])
                state.num_synced_tokens = end
                rows.append(state.row)
                known.append(end)
            else:
                rows.append(self.sync(state, blocks, row_drafts))
                known.append(end + len(row_drafts))
        if new_rows:
            self.token_ids[new_rows, new_cols] = new_tokens
        return (states, drafts, np.asarray(rows, dtype=np.int64),
                np.asarray(known, dtype=np.int64))

    def sync(self, state: RequestState, new_block_ids: list[int], drafts: list[int]) -> int:
        """Copy in the request's tokens sampled since the last sync, its drafts (rewritten
        every step, after the known tokens) and its new blocks; return its row."""
        row = state.row
        start = state.num_synced_tokens
        end = state.num_tokens
        if end > start:
            num_prompt = state.num_prompt_tokens
            if start < num_prompt:
                self.token_ids[row, start:num_prompt] = state.prompt_token_ids[start:]
                start = num_prompt
            self.token_ids[row, start:end] = state.output_token_ids[start - num_prompt:]
            state.num_synced_tokens = end
        drafts = drafts[: self.token_ids.shape[1] - end]
        if drafts:
            self.token_ids[row, end : end + len(drafts)] = drafts
        if new_block_ids:
            n = state.num_blocks
            self.block_table[row, n : n + len(new_block_ids)] = new_block_ids
            state.num_blocks = n + len(new_block_ids)
        return row
