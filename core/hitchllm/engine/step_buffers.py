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
