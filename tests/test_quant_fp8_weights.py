"""fp8 W8A8 weights (hitchllm-quantization ``fp8`` and ``compressed-tensors``): checkpoints
quantized here, in the test, in both formats with per-tensor and per-channel scales, load and
give the logits and greedy tokens of their dequantized float twin run with the same activation
quantization (a reference method written here, in float64); online quantization of a float
checkpoint equals loading the same quantization from disk; bad checkpoints fail at load with
the tensor or option named. The GPU test checks the ``torch._scaled_mm`` path against the
same references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fake_dists import install_fake_plugin
from hitchllm_quantization.fp8_gemm import (
    _quantize_activations,
    check_fp8_device,
    emulated_fp8_linear,
    quantize_activations,
    scaled_mm_fp8_linear,
)
from quant_twin import assert_layers_match, prompt_logprobs, write_checkpoint
from safetensors.torch import load_file, save_file
from test_models_hf_parity import mixed_prompts, run

from hitchllm import LLM, SamplingParams
from hitchllm.tiny_model import build_tiny_checkpoint

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Static activation scales per checkpoint projection; q/k/v (and gate/up) differ so that the
# fused layer's rule (their maximum) is exercised.
STATIC = {"q_proj": 0.02, "k_proj": 0.03, "v_proj": 0.04, "o_proj": 0.01,
          "gate_proj": 0.05, "up_proj": 0.03, "down_proj": 0.02}
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}

# The reference: float weights (the dequantized twin) and activations rounded to fp8 the way
# W8A8 defines it (per token amax / 448, or the static scale), computed in float64.
REFERENCE_PLUGIN = """
import torch
import torch.nn.functional as F

from hitchllm import hookimpl
from hitchllm.layers import LinearBase, UnquantizedLinearMethod


class FakeQuantActivations(UnquantizedLinearMethod):
    def __init__(self, static_scale):
        self.static_scale = static_scale

    def apply(self, layer, x, bias=None):
        x64 = x.double()
        if self.static_scale is None:
            scale = x64.abs().amax(dim=-1, keepdim=True) / 448
        else:
            scale = torch.full_like(x64[..., :1], self.static_scale)
        q = (x64 / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * scale
        out = F.linear(q, layer.weight.double()).to(x.dtype)
        return out if bias is None else out + bias


class Fp8Reference:
    def __init__(self, model_config):
        self.static = model_config.hf_config["quantization_config"]["static"]

    def get_linear_method(self, layer, prefix):
        if not isinstance(layer, LinearBase):
            return None
        return FakeQuantActivations(self.static.get(prefix) if self.static else None)


@hookimpl
def hitchllm_quantization_methods():
    return {"test_fp8_reference": Fp8Reference}
"""


def quantize(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric e4m3: ``(values, scale)`` with ``scale = amax / 448`` per row or tensor."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = amax / 448
    return (w / scale).clamp(-448, 448).to(FP8), scale


def quant_config(fmt: str, per_channel: bool, static: bool) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    acts = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
            if static else
            {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True})
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                        "strategy": "channel" if per_channel else "tensor"},
            "input_activations": acts}},
        "ignore": ["lm_head"],
        # fp8 KV-cache scales are another part of the plugin; the weight method ignores it.
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny Qwen2 (q/k/v biases, made nonzero so they count)."""
    root = tmp_path_factory.mktemp("fp8-source")
    path = build_tiny_checkpoint(root / "float", "Qwen2ForCausalLM", seed=3)
    state = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name, tensor in state.items():
        if name.endswith(".bias"):
            state[name] = torch.randn(tensor.shape, generator=generator) * 0.1
    save_file(state, str(path / "model.safetensors"))
    return path


def make_checkpoints(source: Path, root: Path, fmt: str, per_channel: bool, static: bool,
                     ) -> tuple[str, str]:
    """``(fp8 checkpoint in format fmt, its dequantized float twin with the reference
    method)``."""
    state = load_file(str(source / "model.safetensors"))
    quantized, twin, scales = {}, {}, {}
    for name, tensor in state.items():
        module = name.split(".")[-2]
        if name.endswith(".weight") and module in PROJECTIONS:
            values, scale = quantize(tensor, per_channel)
            twin[name] = values.float() * scale
            stem = name[: -len("weight")]
            if fmt == "fp8":  # per-tensor as a scalar, per-channel as [N]
                scale = scale.reshape(-1) if per_channel else scale.reshape(())
            else:  # compressed-tensors: [N, 1] or [1]
                scale = scale.reshape(-1, 1) if per_channel else scale.reshape(1)
            quantized[name], quantized[stem + "weight_scale"] = values, scale
            if static:
                quantized[stem + "input_scale"] = torch.tensor(STATIC[module])
                prefix = name[: -len(".weight")].replace(module, FUSED.get(module, module))
                scales[prefix] = max(scales.get(prefix, 0.0), STATIC[module])
        else:
            quantized[name] = twin[name] = tensor
    tag = f"{fmt}-{'channel' if per_channel else 'tensor'}-{'static' if static else 'dynamic'}"
    return (
        write_checkpoint(source, root / tag, quantized, quant_config(fmt, per_channel, static)),
        write_checkpoint(source, root / f"{tag}-twin", twin,
                         {"quant_method": "test_fp8_reference", "static": scales}),
    )


@pytest.fixture
def reference_plugin(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-test-fp8-reference", "0.1",
                        "test_fp8_reference_plugin", REFERENCE_PLUGIN)


@pytest.mark.parametrize(("fmt", "per_channel", "static"), [
    ("fp8", False, False), ("fp8", True, False), ("fp8", False, True),
    ("compressed-tensors", False, False), ("compressed-tensors", True, False),
    ("compressed-tensors", True, True),
])
def test_fp8_checkpoint_matches_dequantized_twin_with_quantized_activations(
    reference_plugin, source, tmp_path, fmt, per_channel, static
):
    fp8_path, twin_path = make_checkpoints(source, tmp_path, fmt, per_channel, static)
    quantized = LLM(fp8_path, block_size=4, dtype="float32")
    reference = LLM(twin_path, block_size=4, dtype="float32")

    model = quantized.engine.executor.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (qkv.output_size,)
    assert type(model.lm_head.linear_method).__name__ == "UnquantizedLinearMethod"
    if static:
        assert qkv.input_scale.item() == pytest.approx(max(STATIC[p] for p in STATIC
                                                           if p.endswith(("q_proj", "k_proj",
                                                                          "v_proj"))))

    # Every projection, fed the same input, gives the reference layer's output. The two
    # differ only by float32 vs float64 rounding (~1e-6 relative).
    checked = assert_layers_match(quantized, reference, "weight_scale", scale=0.3 if static else 1,
                                  generator=torch.Generator().manual_seed(1))
    assert checked == 4 * model.config.num_hidden_layers

    # The whole model. The float32 and float64 paths can round a rare activation to the
    # neighbouring fp8 value (1/16 apart); 1e-3 on log-probabilities is far below one such
    # step's effect on a token but far above float32 rounding.
    prompts = mixed_prompts(5, lengths=(3, 18, 33))
    torch.testing.assert_close(prompt_logprobs(quantized, prompts),
                               prompt_logprobs(reference, prompts), rtol=0, atol=1e-3)
    assert run(quantized, prompts) == run(reference, prompts)


def test_online_fp8_equals_the_same_quantization_loaded_from_disk(
    reference_plugin, source, tmp_path
):
    """``quantization="fp8"`` on a float checkpoint quantizes per output channel at load:
    the same numbers as a per-channel fp8 checkpoint of those weights."""
    fp8_path, _ = make_checkpoints(source, tmp_path, "fp8", per_channel=True, static=False)
    online = LLM(str(source), block_size=4, dtype="float32", quantization="fp8")
    stored = LLM(fp8_path, block_size=4, dtype="float32")
    layer = online.engine.executor.runner.model.model.layers[1].mlp.gate_up_proj
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (layer.output_size,)
    prompts = mixed_prompts(6, lengths=(4, 21))
    torch.testing.assert_close(prompt_logprobs(online, prompts),
                               prompt_logprobs(stored, prompts), rtol=0, atol=0)


def test_online_fp8_keeps_the_bundled_models_greedy_tokens_and_loss():
    """On a trained model (the bundled one), over held-out text: the fp8 model's greedy
    (top-1) next token given the same context agrees with the float model's at >= 90% of
    positions (96.8% measured over all of tests/data/heldout_stdlib), and the loss stays
    within 1% (docs/fp8_weights.md records the perplexity numbers)."""
    from hitchllm.entrypoints.bench_perplexity import measure, token_windows

    base, fp8 = LLM(dtype="float32"), LLM(dtype="float32", quantization="fp8")
    text = [sorted((Path(__file__).parent / "data/heldout_stdlib").glob("*.py"))[0].read_text()]
    windows = token_windows(base.get_tokenizer()(text[0]).input_ids, 512)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)

    def greedy_tokens(llm: LLM) -> list[int]:
        outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
        return [min(entry, key=lambda t: entry[t].rank) for out in outs
                for entry in out.prompt_logprobs[1:]]

    ours, theirs = greedy_tokens(fp8), greedy_tokens(base)
    agree = sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(theirs)
    assert 0.9 <= agree < 1, agree  # < 1: the weights really are quantized
    loss, base_loss = measure(fp8, text, 512).loss, measure(base, text, 512).loss
    assert abs(loss - base_loss) / base_loss < 0.01, (loss, base_loss)


def replace_tensor(path: str, name: str, tensor: torch.Tensor) -> None:
    """Overwrite tensor ``name`` in the checkpoint at ``path``."""
    state = load_file(str(Path(path) / "model.safetensors"))
    state[name] = tensor
    save_file(state, str(Path(path) / "model.safetensors"))


def test_wrong_shaped_weight_scale_fails_naming_the_tensor(source, tmp_path):
    fp8_path, _ = make_checkpoints(source, tmp_path, "fp8", per_channel=True, static=False)
    replace_tensor(fp8_path, "model.layers.1.self_attn.k_proj.weight_scale", torch.ones(3))
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_proj.weight_scale'.*"
                                         r"shape \(3,\); expected a per-tensor .* \(32,\)"):
        LLM(fp8_path, block_size=4)

    # compressed-tensors says which strategy it stored: a per-tensor scale under "channel"
    # is refused too.
    ct_path, _ = make_checkpoints(source, tmp_path, "compressed-tensors", per_channel=True,
                                  static=False)
    replace_tensor(ct_path, "model.layers.0.mlp.down_proj.weight_scale", torch.ones(1))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight_scale'.*"
                                         r"expected one per output channel"):
        LLM(ct_path, block_size=4)


def test_float_weights_under_an_fp8_config_are_refused(source, tmp_path):
    state = load_file(str(source / "model.safetensors"))
    for name in list(state):
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            state[name[: -len("weight")] + "weight_scale"] = torch.tensor(1.0)
    path = write_checkpoint(source, tmp_path / "floats", state,
                            {"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(ValueError, match=r"_proj.weight'.*is not float8_e4m3fn.*"
                                         r"quantization='fp8'"):
        LLM(path, block_size=4)


def test_unknown_method_lists_the_installed_ones(source):
    with pytest.raises(ValueError, match=r"'fp9' is not provided.*installed: "
                                         r"awq, compressed-tensors, fp8"):
        LLM(str(source), quantization="fp9")


def test_unsupported_compressed_tensors_schemes_are_refused(source, tmp_path):
    int4 = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                        "symmetric": True},
            "input_activations": None}},
        "ignore": ["lm_head"],
    }
    path = write_checkpoint(source, tmp_path / "int4", {}, int4)
    with pytest.raises(ValueError, match=r"group 'group_0' uses format 'pack-quantized', "
                                         r"weights \(num_bits=4, type=int, strategy=group.*"
                                         r"supported: FP8 W8A8"):
        LLM(path)
    weight_only = json.loads(json.dumps(int4))
    weight_only["format"] = "float-quantized"
    weight_only["config_groups"]["group_0"]["weights"] = {
        "num_bits": 8, "type": "float", "strategy": "channel"}
    path = write_checkpoint(source, tmp_path / "w8a16", {}, weight_only)
    with pytest.raises(ValueError, match=r"input_activations \(none\).*supported"):
        LLM(path)
    with pytest.raises(ValueError, match="already quantized with 'compressed-tensors'"):
        LLM(path, quantization="fp8")
    sparse = json.loads(json.dumps(quant_config("compressed-tensors", True, False)))
    sparse["sparsity_config"] = {"format": "sparse-24-bitmask"}
    path = write_checkpoint(source, tmp_path / "sparse", {}, sparse)
    with pytest.raises(ValueError, match="sparsity format 'sparse-24-bitmask' is not supported"):
        LLM(path)


def test_a_gpu_without_fp8_is_refused_naming_the_card(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4")
    with pytest.raises(ValueError, match=r"sm_89\+.*NVIDIA A100-SXM4 is sm_80"):
        check_fp8_device(torch.device("cuda", 0))
    check_fp8_device(torch.device("cpu"))  # the CPU runs the emulated path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_mm_matches_the_emulated_and_dequantized_product(dtype):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 256, generator=generator)
    values, scale = quantize(weight, per_channel=True)
    values, scale = values.cuda(), scale.reshape(-1).cuda()
    for rows in (1, 5, 16, 33, 256):
        x = torch.randn(rows, 256, generator=generator).to("cuda", dtype)
        xq, x_scale = quantize_activations(x)  # compiled on CUDA
        eager_q, eager_scale = _quantize_activations(x, None)
        torch.testing.assert_close(x_scale, eager_scale, rtol=1e-6, atol=0)
        # A compiled division may round a value on an fp8 boundary the other way: rare.
        assert (xq.float() != eager_q.float()).float().mean() < 1e-3
        got = scaled_mm_fp8_linear(xq, x_scale, values, scale, dtype)
        assert got.dtype == dtype
        emulated = emulated_fp8_linear(xq, x_scale, values, scale, torch.float32)
        dequantized = (xq.double() * x_scale) @ (values.double() * scale[:, None]).t()
        # Tensor cores sum in float32 in another order; the output is written in bfloat16
        # (see scaled_mm_fp8_linear), which rounds last.
        tol = 1e-2
        torch.testing.assert_close(got.float(), emulated, rtol=tol, atol=tol)
        torch.testing.assert_close(got.double(), dequantized, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_fp8_checkpoint_on_cuda_uses_scaled_mm_and_matches_the_twin(
    reference_plugin, source, tmp_path
):
    fp8_path, twin_path = make_checkpoints(source, tmp_path, "compressed-tensors",
                                           per_channel=True, static=False)
    quantized = LLM(fp8_path, block_size=16, dtype="float32", device="cuda")
    reference = LLM(twin_path, block_size=16, dtype="float32", device="cuda")
    qkv = quantized.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.linear_method.use_scaled_mm
    prompts = mixed_prompts(5, lengths=(3, 18, 33))
    ours, theirs = prompt_logprobs(quantized, prompts), prompt_logprobs(reference, prompts)
    # Every layer's output is rounded to bfloat16 (about 0.2%; see scaled_mm_fp8_linear),
    # a few percent on the log-probabilities of unlikely tokens.
    torch.testing.assert_close(ours, theirs, rtol=0.06, atol=5e-2)


def test_ignored_layers_stay_in_float(source, tmp_path):
    """``ignored_layers`` (fp8) and ``ignore`` (compressed-tensors, with ``re:`` patterns)
    keep layers in float: their checkpoint tensors are float weights without scales."""
    for fmt, ignore in (("fp8", ["model.layers.1.mlp.down_proj"]),
                        ("compressed-tensors", ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"])):
        path, _ = make_checkpoints(source, tmp_path / fmt, fmt, per_channel=True, static=False)
        state = load_file(str(Path(path) / "model.safetensors"))
        original = load_file(str(source / "model.safetensors"))
        name = "model.layers.1.mlp.down_proj.weight"
        state[name] = original[name]
        del state["model.layers.1.mlp.down_proj.weight_scale"]
        save_file(state, str(Path(path) / "model.safetensors"))
        config = json.loads((Path(path) / "config.json").read_text())
        config["quantization_config"]["ignored_layers" if fmt == "fp8" else "ignore"] = ignore
        (Path(path) / "config.json").write_text(json.dumps(config))
        model = LLM(path, block_size=4, dtype="float32").engine.executor.runner.model
        down = model.model.layers[1].mlp.down_proj
        assert type(down.linear_method).__name__ == "UnquantizedLinearMethod"
        torch.testing.assert_close(down.weight, original[name], rtol=0, atol=0)
        assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8


def test_scaled_mm_path_wiring_runs_on_the_cpu_where_torch_has_it(
    reference_plugin, source, tmp_path, monkeypatch
):
    """The engine's ``torch._scaled_mm`` path (operand layouts, scale shapes, output dtype),
    run through torch's CPU implementation of the op, gives the twin's numbers: the GPU
    wiring is exercised here too, not only on a GPU machine."""
    import hitchllm_quantization.fp8 as fp8

    one = torch.ones(1, 1)
    try:
        torch._scaled_mm(torch.zeros(16, 16, dtype=FP8), torch.zeros(16, 16, dtype=FP8).t(),
                         scale_a=one.expand(16, 1).contiguous(), scale_b=one.expand(1, 16)
                         .contiguous(), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        pytest.skip("this torch has no CPU torch._scaled_mm")
    monkeypatch.setattr(fp8, "fp8_capable", lambda device: True)
    fp8_path, twin_path = make_checkpoints(source, tmp_path, "fp8", per_channel=False,
                                           static=True)
    quantized = LLM(fp8_path, block_size=4, dtype="float32")
    reference = LLM(twin_path, block_size=4, dtype="float32")
    qkv = quantized.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.linear_method.use_scaled_mm
    prompts = mixed_prompts(5, lengths=(3, 18, 33))
    # Each layer's output is written in bfloat16 (see scaled_mm_fp8_linear): about 0.2% per
    # layer, which grows to a few percent on the log-probabilities of unlikely tokens. A wiring
    # error (layout, scales) changes them wholesale.
    torch.testing.assert_close(prompt_logprobs(quantized, prompts),
                               prompt_logprobs(reference, prompts), rtol=0.06, atol=5e-2)


def test_without_the_plugin_fp8_names_the_package_to_install(source, monkeypatch):
    monkeypatch.setenv("HITCHLLM_PLUGINS", "attention_cpu")  # not the quantization plugin
    with pytest.raises(ValueError, match=r"'fp8' is not provided.*installed: none.*"
                                         r"pip install -e plugins/quantization"):
        LLM(str(source), quantization="fp8")
