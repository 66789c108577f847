"""AWQ int4 checkpoints (``quant_method == "awq"``, GEMM packing): the nibble order is the
published one, a checkpoint quantized here loads and gives the logits and greedy tokens of its
dequantized float twin, the Triton kernel matches the torch dequantized reference, and bad
checkpoints and configs are refused with the tensor or field named."""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from gpu_compile import compile_check_lines
from hitchllm_quantization.awq import AWQConfig
from hitchllm_quantization.awq_packing import (
    dequantize,
    pack_along_k,
    pack_int4,
    quantize_rtn,
    unpack_along_k,
    unpack_int4,
)
from quant_twin import assert_layers_match, prompt_logprobs, write_checkpoint
from safetensors.torch import load_file, save_file
from test_models_hf_parity import mixed_prompts, run

from hitchllm import LLM
from hitchllm.tiny_model import build_tiny_checkpoint

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
FLOAT_LAYER = "model.layers.1.mlp.down_proj"  # modules_to_not_convert keeps it in float


def test_packing_follows_the_published_interleaved_nibble_order():
    """AutoAWQ packs output columns 0..7 into nibbles 0..7 in the order [0, 2, 4, 6, 1, 3, 5,
    7]: nibble i holds column AWQ_ORDER[i]. Columns 0..7 holding their own index therefore pack
    to 0x75316420, and the value 15 in column 7 (nibble 7) sets the int32's sign bit."""
    columns = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 0, 0, 15]])
    packed = pack_int4(columns)
    assert packed.dtype == torch.int32
    assert packed[0].item() == 0x75316420
    assert packed[1].item() == (15 << 28) - 2**32
    assert torch.equal(unpack_int4(packed), columns.to(torch.int32))

    values = torch.randint(0, 16, (12, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4(pack_int4(values)), values.to(torch.int32))


def test_the_kernels_layout_packs_input_rows_in_plain_nibble_order():
    """pack_along_k: input rows 0..7 of one column land in nibbles 0..7 of one word, so rows
    holding their own index pack to 0x76543210; zero points become one byte each."""
    rows = torch.arange(8).repeat_interleave(8).reshape(8, 8)  # row r holds r in all columns
    words, zeros = pack_along_k(pack_int4(rows), pack_int4(rows[:1]))
    assert words.shape == (1, 8) and words.dtype == torch.int32
    assert (words == 0x76543210).all()
    assert zeros.dtype == torch.uint8 and torch.equal(zeros, rows[:1].to(torch.uint8))
    values = torch.randint(0, 16, (24, 40), generator=torch.Generator().manual_seed(0))
    words, _ = pack_along_k(pack_int4(values), pack_int4(values[:3]))
    assert torch.equal(unpack_along_k(words), values.to(torch.int32))


def test_round_to_nearest_groups_dequantize_within_half_a_step():
    weight = torch.randn(24, 4 * GROUP, generator=torch.Generator().manual_seed(1))
    qweight, qzeros, scales = quantize_rtn(weight, GROUP)
    assert (qweight.shape, qzeros.shape, scales.shape) == ((128, 3), (4, 3), (4, 24))
    step = scales.float().repeat_interleave(GROUP, 0).T
    error = (dequantize(qweight, qzeros, scales, GROUP) - weight).abs()
    assert (error <= step / 2 + 1e-6).all()
    assert error.max() > step.min() / 8  # quantization did happen


def awq_checkpoint(source: Path, root: Path, group_size: int = GROUP) -> tuple[Path, Path]:
    """``(AWQ checkpoint, its dequantized float twin)`` of ``source``, the projections
    quantized here per group of ``group_size`` inputs except ``FLOAT_LAYER``."""
    state = load_file(str(source / "model.safetensors"))
    quantized, twin = {}, {}
    generator = torch.Generator().manual_seed(0)
    for name, tensor in state.items():
        if name.endswith(".bias"):  # transformers initializes them to zero: make them count
            tensor = torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * 0.1
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS and (
                module != FLOAT_LAYER):
            qweight, qzeros, scales = quantize_rtn(tensor, group_size)
            quantized.update({f"{module}.qweight": qweight, f"{module}.qzeros": qzeros,
                              f"{module}.scales": scales})
            twin[name] = dequantize(qweight, qzeros, scales, group_size, tensor.dtype).contiguous()
        else:
            quantized[name] = twin[name] = tensor
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": [FLOAT_LAYER]}
    return (Path(write_checkpoint(source, root / "awq", quantized, config)),
            Path(write_checkpoint(source, root / "twin", twin)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("awq")
    source = build_tiny_checkpoint(root / "source", "Qwen2ForCausalLM", seed=7)
    return awq_checkpoint(source, root)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_awq_checkpoint_matches_its_dequantized_float_twin(checkpoints, device):
    """On the CPU the torch dequantizing path, on CUDA the Triton kernel (float32 products,
    so the tolerance only allows for the order of summation)."""
    awq_path, twin_path = checkpoints
    quantized = LLM(str(awq_path), block_size=4, dtype="float32", device=device)
    reference = LLM(str(twin_path), block_size=4, dtype="float32", device=device)
    tol = 1e-5 if device == "cpu" else 1e-4

    model = quantized.engine.executor.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.int32
    if device == "cpu":  # AWQ's packing, as loaded
        assert qkv.qweight.shape == (qkv.input_size, qkv.output_size // 8)
    else:  # re-laid out for the kernels: packed along the input, zero points one byte each
        assert qkv.qweight.shape == (qkv.input_size // 8, qkv.output_size)
        assert qkv.qzeros.dtype == torch.uint8
    assert qkv.scales.shape == (qkv.input_size // GROUP, qkv.output_size)
    assert type(model.model.layers[1].mlp.down_proj.linear_method).__name__ == (
        "UnquantizedLinearMethod")
    assert type(model.lm_head.linear_method).__name__ == "UnquantizedLinearMethod"

    # Every projection, fed the same input, gives the float layer's output.
    assert assert_layers_match(quantized, reference, "qweight", tol) == (
        4 * model.config.num_hidden_layers - 1)

    prompts = mixed_prompts(5, lengths=(3, 18, 33))
    torch.testing.assert_close(prompt_logprobs(quantized, prompts),
                               prompt_logprobs(reference, prompts), rtol=tol, atol=tol)
    assert run(quantized, prompts) == run(reference, prompts)


def rewrite(path: Path, target: Path, edit) -> Path:
    """A copy of checkpoint ``path`` at ``target`` with ``edit(state)`` applied."""
    shutil.copytree(path, target)
    state = load_file(str(target / "model.safetensors"))
    edit(state)
    save_file(state, str(target / "model.safetensors"))
    return target


@pytest.mark.parametrize("tensor", ["scales", "qzeros", "qweight"])
def test_a_wrongly_shaped_awq_tensor_is_refused_with_its_name(checkpoints, tmp_path, tensor):
    name = f"model.layers.0.self_attn.k_proj.{tensor}"

    def drop_a_column(state):
        state[name] = state[name][:, :-1].contiguous()

    bad = rewrite(checkpoints[0], tmp_path / "bad", drop_a_column)
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}'.*expected"):
        LLM(str(bad), block_size=4)


def test_a_group_size_that_does_not_divide_the_input_is_refused(checkpoints, tmp_path):
    path = tmp_path / "g48"
    shutil.copytree(checkpoints[0], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["group_size"] = 48
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="AWQ group_size 48 does not divide the input size 64 "
                                         "of model.layers.0.self_attn.qkv_proj"):
        LLM(str(path), block_size=4)


@pytest.mark.parametrize(("change", "message"), [
    ({"bits": 8}, "bits is 8; only 4 is supported"),
    ({"w_bit": 3}, "bits is 3; only 4 is supported"),
    ({"version": "gemv"}, "version is 'gemv'; only 'gemm'"),
    ({"version": "marlin"}, "version is 'marlin'; only 'gemm'"),
    ({"zero_point": False}, "zero_point is false; only zero_point true"),
    ({"group_size": 0}, "group_size is 0; use a positive group size"),
    ({"quant_method": "gptq"}, "this one has 'gptq'"),
    ({"modules_to_not_convert": ["q_proj"]}, "some of .* in float but not all"),
])
def test_unsupported_awq_configs_are_refused_naming_the_field(change, message):
    config = {"quant_method": "awq", "group_size": 128, "zero_point": True,
              "version": "GEMM"} | change  # no "bits": AutoAWQ's default is 4, or "w_bit"
    with pytest.raises(ValueError, match=message):
        AWQConfig(config).is_converted("model.layers.0.self_attn.qkv_proj")


def test_quantization_awq_on_a_float_checkpoint_is_refused(llama_path):
    with pytest.raises(ValueError, match="quant_method 'awq'; this one has None"):
        LLM(llama_path, block_size=4, quantization="awq")


@functools.cache
def awq_layer(out_features: int, in_features: int, group_size: int, seed: int = 0):
    """AWQ tensors of a random weight, and their float32 dequantized weight ``[out, in]``."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    qweight, qzeros, scales = quantize_rtn(weight, group_size)
    return (qweight, qzeros, scales), dequantize(qweight, qzeros, scales, group_size)


# Tiles for each path of the kernels (GEMV and split-K with atomic adds, whole tiles stored
# directly), also with groups smaller than the tile (each row reads its group's scales).
TILES = {
    "gemv": ("gemv", {"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 3}),
    "gemv_tile_is_group": ("gemv", {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1}),
    "split_k": ("split_k", {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 3}),
    "tiles": ("tiles", {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1}),
    "tiles_split_k": ("tiles", {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2}),
    "dequantize": ("dequantize", None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tile", "m"), [
    (tile, m) for tile in sorted(TILES) for m in ((1, 3) if tile.startswith("gemv") else (1, 5, 37))
])
def test_triton_kernel_matches_the_dequantized_reference(dtype, tile, m):
    """Under the Triton interpreter (no GPU here): N = 40 leaves a partial column tile, K = 192
    a partial K tile for 64-wide tiles; the reference multiplies the same dequantized weight
    (rounded to ``dtype``, as the kernel feeds tl.dot) in float64."""
    from hitchllm_quantization.awq_triton import awq_gemm

    (qweight, qzeros, scales), weight = awq_layer(40, 192, GROUP)
    x = torch.randn(m, 192, generator=torch.Generator().manual_seed(m)).to(dtype)
    path, config = TILES[tile]
    got = awq_gemm(x, *pack_along_k(qweight, qzeros), scales, GROUP, config, path)
    want = x.double() @ weight.to(dtype).double().T
    assert got.dtype == dtype and got.shape == (m, 40)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("k", "n"), [(4096, 14336), (14336, 4096), (4096, 4096)])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256])
def test_triton_kernel_on_llama_8b_shapes_matches_the_dequantized_reference(dtype, k, n, m):
    """The autotuned kernel on the GPU at a Llama-8B layer's shapes, group size 128."""
    from hitchllm_quantization.awq_triton import awq_gemm

    (qweight, qzeros, scales), weight = awq_layer(n, k, 128)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    words, zeros = pack_along_k(qweight, qzeros)
    got = awq_gemm(x.cuda(), words.cuda(), zeros.cuda(), scales.cuda(), 128).cpu()
    want = x.double() @ weight.to(dtype).double().T
    assert got.dtype == dtype
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=0.02, atol=0.01 * scale)


def test_kernels_compile_for_an_h100_without_one(tmp_path):
    """Triton's compiler and ptxas run on any machine: the first autotuning config of every
    path compiles for sm_90 and fits its shared memory (the interpreter checks none of this).
    A fresh process, since this one's kernels are the interpreter's."""
    lines = compile_check_lines("hitchllm_quantization.awq_compile_check", tmp_path)
    assert len(lines) == 6 and all(line.endswith("fits") for line in lines), lines


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts"
                                                  / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rtn_script_writes_a_checkpoint_that_loads_as_awq(llama_path, tmp_path):
    """scripts/quantize_awq_rtn.py: every projection becomes qweight/qzeros/scales whose
    dequantization is within half a step of the original weight, config.json says awq, the
    engine loads it; the agreement measure gives 1.0 for a model against itself."""
    script = load_script("quantize_awq_rtn")
    out = tmp_path / "awq"
    assert script.quantize_checkpoint(Path(llama_path), out, GROUP) == 2 * 7
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config | {"modules_to_not_convert": None} == {
        "quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None}
    original = load_file(str(Path(llama_path) / "model.safetensors"))
    state = load_file(str(out / "model.safetensors"))
    module = "model.layers.1.mlp.down_proj"
    assert f"{module}.weight" not in state
    weight = dequantize(state[f"{module}.qweight"], state[f"{module}.qzeros"],
                        state[f"{module}.scales"], GROUP)
    step = state[f"{module}.scales"].float().repeat_interleave(GROUP, 0).T
    assert ((weight - original[f"{module}.weight"].float()).abs() <= step / 2 + 1e-6).all()

    text = Path(__file__).parent / "data" / "heldout_stdlib" / "shelve.py"
    same = script.greedy_agreement(llama_path, llama_path, [text.read_text()], window=64,
                                   continuations=4)
    assert same["top1_agreement"] == 1.0 and same["identical_continuations"] == 1.0
    quantized = script.greedy_agreement(llama_path, str(out), [text.read_text()], window=64,
                                        continuations=4)
    assert quantized["positions"] == same["positions"] > 100
    assert 0 < quantized["top1_agreement"] <= 1
