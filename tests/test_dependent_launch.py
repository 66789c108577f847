"""Programmatic dependent launch (``hitchllm.attention.dependent_launch``): when kernels launch
dependent, and that every kernel launched so waits for its inputs before it touches memory (its
PTX compiled for an H100, which needs no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hitchllm.attention import dependent_launch as dl

# Compiles the engine's dependent kernels for sm_90 with PDL on and off and prints, per kernel
# and setting, the PTX line numbers of the first griddepcontrol.wait, the first
# launch_dependents and the first global memory access (-1: none).
_CHECK = r"""
import re
from hitchllm.attention.triton_support import compile_for_gpu
from hitchllm.models import elementwise_kernels, rotary_kernel, split_k_kernels
from hitchllm_attention_triton import kernels

BF16 = "*bf16"
CASES = {
    "partials": (split_k_kernels._partials_kernel,
                 dict(BM=16, BN=32, BK=64, IEEE=False),
                 {"x_ptr": BF16, "w_ptr": BF16, "parts_ptr": "*fp32"}, 4),
    "add_norm": (elementwise_kernels._norm_kernel,
                 dict(SPLITS=4, ADD=True, BLOCK=1024, PTX=True),
                 {"x_ptr": "*fp32", "residual_ptr": BF16, "weight_ptr": BF16,
                  "out_ptr": BF16, "total_ptr": BF16, "inv_columns": "fp32", "eps": "fp32"}, 1),
    "rms_norm": (elementwise_kernels._norm_kernel,
                 dict(SPLITS=1, ADD=False, BLOCK=1024, PTX=True),
                 {"x_ptr": BF16, "residual_ptr": BF16, "weight_ptr": BF16,
                  "out_ptr": BF16, "total_ptr": BF16, "inv_columns": "fp32", "eps": "fp32"}, 1),
    "silu_mul": (elementwise_kernels._silu_mul_kernel,
                 dict(BLOCK=1024, LIBDEVICE=True, PTX=True),
                 {"x_ptr": BF16, "out_ptr": BF16}, 1),
    "norm_rotary": (rotary_kernel._norm_rotary_kernel,
                    dict(Q_HEADS=16, Q_PAD=16, K_HEADS=8, K_PAD=8, HALF=64, HALF_PAD=64,
                         NORM=True, PTX=True),
                    {"pos_ptr": "*i64", "q_ptr": BF16, "k_ptr": BF16, "q_out_ptr": BF16,
                     "k_out_ptr": BF16, "q_w_ptr": BF16, "k_w_ptr": BF16, "cos_ptr": "*fp32",
                     "sin_ptr": "*fp32", "eps": "fp32"}, 1),
    "write_kv_cache": (kernels.write_kv_cache,
                       dict(TOKEN_SIZE=1024, TOKEN_PAD=1024, FP8_MAX=0.0, MANT_BITS=0,
                            MIN_EXP=0),
                       {"key_ptr": BF16, "value_ptr": BF16, "cache_ptr": BF16,
                        "slot_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}, 1),
    "paged_attention": (kernels.paged_attention,
                        dict(GROUP=2, HEAD_DIM=128, HEAD_PAD=128, BLOCK_Q=1, BLOCK_M=16,
                             BLOCK_N=64, PAGE=16, USE_SOFTCAP=False, WINDOW=0, NUM_SPLITS=4,
                             DECODE=True, FP8=False, V_WORD=1, ASM_CVT=False,
                             LONGEST_FIRST=True),
                        {"out_ptr": BF16, "q_ptr": BF16, "k_cache_ptr": BF16,
                         "v_cache_ptr": BF16, "block_table_ptr": "*i32",
                         "seq_lens_ptr": "*i32", "query_start_ptr": "*i32",
                         "tile_req_ptr": "*i32", "tile_q0_ptr": "*i32",
                         "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
                         "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "qk_scale": "fp32",
                         "soft_cap": "fp32"}, 3),
    "merge_splits": (kernels.merge_splits,
                     dict(HEAD_DIM=128, HEAD_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4),
                     {"out_ptr": BF16, "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"},
                     1),
}
MEMORY = re.compile(r"^\s*(@%p\d+\s+)?(ld|st|cp\.async|atom|red)\.[\w.:]*global")


def first(lines, pattern):
    return next((i for i, line in enumerate(lines) if re.search(pattern, line)), -1)


for name, (kernel, constexprs, types, stages) in CASES.items():
    for pdl in (True, False):
        ptx = compile_for_gpu(kernel, constexprs | {"PDL": pdl}, types, set(types), 4,
                              stages).asm["ptx"].splitlines()
        memory = next((i for i, line in enumerate(ptx) if MEMORY.match(line)), -1)
        print(name, pdl, first(ptx, r"griddepcontrol\.wait"),
              first(ptx, r"griddepcontrol\.launch_dependents"), memory)
"""


@pytest.fixture
def gpu_like(monkeypatch):
    """A stand-in for a tensor on CUDA device 0 of an sm_90 GPU, Triton compiling."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(dl.ENV, raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(dl, "_capable", lambda index: True)
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


def test_dependent_on_hopper_gpus_unless_turned_off(gpu_like, monkeypatch):
    assert dl.dependent_launch(gpu_like)
    monkeypatch.setenv(dl.ENV, "0")
    assert not dl.dependent_launch(gpu_like)
    monkeypatch.setenv(dl.ENV, "1")
    assert dl.dependent_launch(gpu_like)


def test_the_launch_keyword_only_where_dependent(gpu_like, monkeypatch):
    """``launch_pdl`` goes to the launch only when true: Triton's AMD backend and Triton before
    3.4 refuse the keyword; such a Triton (no ``gdc_wait``) never launches dependent."""
    assert dl.launch_options(True) == {"launch_pdl": True}
    assert dl.launch_options(False) == {}
    monkeypatch.setattr(dl, "gdc_wait", None)
    assert not dl.dependent_launch(gpu_like)


def test_not_dependent_elsewhere(gpu_like, monkeypatch):
    """CPU tensors, Triton's interpreter, ROCm and GPUs before Hopper launch plainly."""
    assert not dl.dependent_launch(torch.zeros(1))
    monkeypatch.setattr(dl, "_capable", lambda index: False)
    assert not dl.dependent_launch(gpu_like)
    monkeypatch.setattr(dl, "_capable", lambda index: True)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not dl.dependent_launch(gpu_like)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dl.dependent_launch(gpu_like)


def test_kernels_wait_before_touching_memory(tmp_path):
    """Compiled for an H100 with ``PDL``, each dependent kernel's first global load or store
    comes after its ``griddepcontrol.wait`` (and the next kernel's launch is released after
    it); without ``PDL`` there is no grid dependency control at all. A fresh process: this
    one's kernels are the interpreter's."""
    env = os.environ | {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = set()
    for line in result.stdout.splitlines():
        name, pdl, wait, release, memory = line.split()
        wait, release, memory = int(wait), int(release), int(memory)
        seen.add((name, pdl))
        assert memory >= 0, line
        if pdl == "True":
            assert 0 <= wait < release < memory, line
        else:
            assert wait == release == -1, line
    assert len(seen) == 16 and {n for n, _ in seen} >= {"paged_attention", "norm_rotary"}
