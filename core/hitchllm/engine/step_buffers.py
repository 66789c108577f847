"""Persistent buffers for one step's flat inputs: filled on the host, copied to the device.

Every step writes its inputs (token ids, positions, slot mapping, query start locations,
sequence lengths, block table) into the same pinned host tensors through numpy views and copies
them to the same device tensors with non-blocking copies. Nothing is allocated per step, and the
device tensors never move, which is what CUDA-graph replay needs: a graph captured once reads
whatever the latest step wrote there.

A host buffer is rewritten only after the previous step's results were read back (that read
waits for the copies issued before it), so one set of host buffers is enough.
"""

from __future__ import annotations

import numpy as np
import torch

from hitchllm.attention import CommonAttentionMetadata


class HostDeviceBuffer:
    """A pinned host tensor (with a numpy view) and a device tensor of the same shape.

    On a CPU engine both are the same tensor and ``to_device`` copies nothing.
    """

    def __init__(self, shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device):
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np: np.ndarray = self.cpu.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.cpu

    def to_device(self, n: int) -> torch.Tensor:
        """Copy the first ``n`` rows to the device (asynchronously); return them there."""
        if self.device is not self.cpu:
            self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device[:n]


class StepBuffers:
    """All per-step input buffers of a model runner, sized for its largest step."""

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        self.input_ids = HostDeviceBuffer(max_num_tokens, torch.int64, device)
        self.positions = HostDeviceBuffer(max_num_tokens, torch.int64, device)
        self.slot_mapping = HostDeviceBuffer(max_num_tokens, torch.int64, device)
        self.logits_indices = HostDeviceBuffer(max_num_tokens, torch.int64, device)
        # Tokens whose id is still on the device (see ModelRunner.execute_async): where they
        # go in ``input_ids`` and which input-batch row sampled them; and the rows sampled.
        self.pending_dst = HostDeviceBuffer(max_num_reqs, torch.int64, device)
        self.pending_rows = HostDeviceBuffer(max_num_reqs, torch.int64, device)
        self.sample_rows = HostDeviceBuffer(max_num_reqs, torch.int64, device)
        self.query_start_loc = HostDeviceBuffer(max_num_reqs + 1, torch.int32, device)
        self.seq_lens = HostDeviceBuffer(max_num_reqs, torch.int32, device)
        self.num_computed = HostDeviceBuffer(max_num_reqs, torch.int32, torch.device("cpu"))
        # The block table travels packed ([num_reqs, num_cols] of this step, one contiguous
        # copy) and is unpacked on the device into the fixed-stride table the kernels read.
        self.block_table_packed = HostDeviceBuffer(
            max_num_reqs * max_blocks_per_req, torch.int32, device)
        self.block_table = torch.zeros((max_num_reqs, max_blocks_per_req), dtype=torch.int32,
                                       device=device)

    def set_block_table(self, table: np.ndarray) -> torch.Tensor:
        """Write ``table`` ([num_reqs, num_cols]) into the block table's top-left corner; return
        the table's first ``num_reqs`` rows (full width)."""
        n, cols = table.shape
        self.block_table_packed.np[: n * cols] = table.ravel()
        packed = self.block_table_packed.to_device(n * cols).view(n, cols)
        self.block_table[:n, :cols].copy_(packed)
        return self.block_table[:n]

    def pad_decode_inputs(self, start: int, size: int) -> None:
        """Padding tokens ``start..size-1`` of a graph batch: token 0 at position 0, slot -1
        (nothing written)."""
        self.input_ids.np[start:size] = 0
        self.positions.np[start:size] = 0
        self.slot_mapping.np[start:size] = -1

    def common_metadata(
        self, num_sched: np.ndarray, num_computed: np.ndarray, block_table: np.ndarray,
        num_tokens: int, cuda_graph: bool, max_model_len: int, padded_reqs: int | None = None,
        pad_query_len: int = 1,
    ) -> CommonAttentionMetadata:
        """Write the per-request buffers and describe the batch. Padding requests (up to
        ``padded_reqs``) get ``pad_query_len`` query tokens and a context length of 0; a
        CUDA-graph batch declares ``max_model_len`` as its longest sequence (the graph serves
        any)."""
        num_reqs = len(num_sched)
        total_reqs = padded_reqs or num_reqs
        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.cumsum(num_sched, out=qsl[1 : num_reqs + 1])
        seq_lens = self.seq_lens.np
        seq_lens[:num_reqs] = num_computed + num_sched
        self.num_computed.np[:num_reqs] = num_computed
        if total_reqs > num_reqs:
            num_pad = total_reqs - num_reqs
            qsl[num_reqs + 1 : total_reqs + 1] = (num_tokens
                                                  + pad_query_len * np.arange(1, num_pad + 1))
            seq_lens[num_reqs:total_reqs] = 0
            self.num_computed.np[num_reqs:total_reqs] = 0
        if len(block_table):
            self.set_block_table(block_table)
        total_tokens = int(qsl[total_reqs])
        max_seq_len = int(seq_lens[:num_reqs].max()) if num_reqs else 0
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.to_device(total_reqs + 1),
            query_start_loc_cpu=self.query_start_loc.cpu[: total_reqs + 1],
            seq_lens=self.seq_lens.to_device(total_reqs),
            seq_lens_cpu=self.seq_lens.cpu[:total_reqs],
            num_computed_tokens_cpu=self.num_computed.cpu[:total_reqs],
            block_table=self.block_table[:total_reqs],
            block_table_cpu=torch.from_numpy(np.ascontiguousarray(block_table, dtype=np.int32)),
            slot_mapping=self.slot_mapping.to_device(total_tokens),
            num_reqs=total_reqs,
            num_actual_tokens=total_tokens,
            max_query_len=max(int(num_sched.max()) if num_reqs else 1,
                              pad_query_len if total_reqs > num_reqs else 1),
            max_seq_len=max_model_len if cuda_graph else max_seq_len,
            cuda_graph=cuda_graph,
        )
