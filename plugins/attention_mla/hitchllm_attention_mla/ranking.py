"""Auto mode's order of the MLA backends: one table, the only place to change it.

The selector (``hitchllm.attention.selector``) takes, among the backends whose ``validate``
accepts the model and device, the one with the highest ``priority`` class attribute; every MLA
backend of this plugin reads its priority from ``MLA_BACKEND_PRIORITY``. Standard backends
refuse MLA models, so these numbers only order the MLA backends among themselves (they stay
above the core TORCH backend's 0 all the same).

The order is meant to follow measured speed on the GPU: decode bandwidth from
``benchmarks/mla_decode.py`` and end-to-end throughput from ``benchmarks/throughput_gpu.sh
deepseek-backends``. Measured on an H100 (benchmarks/RESULTS.md, DeepSeek-V2-Lite shape,
nano-vllm workload): TRITON_MLA 2813 output tok/s, FLASHINFER_MLA 1305. FlashInfer's decode
kernel is 2.5-3x faster than ours, but TRITON_MLA replays decode steps from CUDA graphs and
FLASHINFER_MLA runs them eagerly, which costs more; hence TRITON_MLA, FLASHINFER_MLA, then the
TORCH_MLA reference. Revisit when FLASHINFER_MLA captures graphs. To change it, edit the table (a
test checks that each backend reads its entry) and the table in the plugin README.
"""

from __future__ import annotations

#: Backend name -> auto-mode priority (higher wins among the valid backends).
MLA_BACKEND_PRIORITY: dict[str, int] = {
    "TRITON_MLA": 110,
    "FLASHINFER_MLA": 100,
    "TORCH_MLA": 10,
}
