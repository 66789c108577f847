"""Persistent host-side rows for running requests: token ids and block tables.

Each running request owns a row. Between steps only what changed is copied in (newly sampled
tokens, newly allocated blocks), so building a step's flat tensors is a handful of vectorized
numpy gathers instead of per-token Python loops.
"""

from __future__ import annotations

import numpy as np

from hitchllm.request import Request


class InputBatch:
    """Rows of token ids ``[max_num_reqs, max_model_len]`` and block ids per request."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self._num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self._num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def release(self, request_id: str) -> None:
        """Give a request's row back (it finished or was preempted)."""
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._num_tokens[row] = 0
            self._num_blocks[row] = 0
            self._free_rows.append(row)

    def sync(self, request: Request, block_ids: list[int]) -> int:
        """Copy in the request's tokens and blocks added since the last sync; return its row."""
        row = self._row_of.get(request.request_id)
        if row is None:
            if not self._free_rows:
                raise RuntimeError("more running requests than max_num_seqs rows")
            row = self._free_rows.pop()
            self._row_of[request.request_id] = row
        start = self._num_tokens[row]
        end = request.num_tokens
        if end > start:
            self.token_ids[row, start:end] = request.all_token_ids[start:end]
            self._num_tokens[row] = end
        spec = request.spec_token_ids[: self.token_ids.shape[1] - end]
        if spec:  # drafts sit after the known tokens and are rewritten every step
            self.token_ids[row, end : end + len(spec)] = spec
        start = self._num_blocks[row]
        if len(block_ids) > start:
            self.block_table[row, start : len(block_ids)] = block_ids[start:]
            self._num_blocks[row] = len(block_ids)
        return row
