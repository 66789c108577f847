"""fp8 KV cache with the hitchllm-quantization plugin: the core refuses fp8 without it, naming
the package; per-layer k_scale / v_scale load from a checkpoint (compressed-tensors names and
the older k_proj/v_proj output_scale), or are computed from the first prompts served
(calculate_kv_scales); CPU_ATTN reads an fp8 cache like TORCH does; fp8 doubles the blocks.

The scale tests use a "shrunk" checkpoint: k_proj and v_proj scaled by 1e-3 and q_proj and
o_proj by 1e3, the same function in exact arithmetic, but with K/V so small that an fp8 cache
with scale 1.0 rounds them into fp8's subnormals (visibly wrong logprobs), while well-chosen
scales keep them at full fp8 precision (logprobs close to the float32 cache's)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from attention_reference import make_batch, reference_attention
from hitchllm_quantization.fp8_kv import KVScaleCalibration
from quant_twin import write_checkpoint
from safetensors.torch import load_file
from test_kv_cache_spec import FP8, fp8_rounded
from test_torch_attention import CASES

from hitchllm import LLM, SamplingParams, hookimpl
from hitchllm.attention import (
    Attention,
    AttentionSpec,
    KVCacheSpec,
    TorchAttentionBackend,
    kernel_reasons,
    set_forward_context,
)
from hitchllm.config import EngineConfig, EngineConfigError
from hitchllm.engine import worker
from hitchllm.entrypoints.backends_table import print_backends
from hitchllm.entrypoints.cli import build_parser, engine_kwargs
from hitchllm.plugins import get_plugin_registry
from hitchllm.tiny_model import build_tiny_checkpoint

SHRINK = 1e-3
PROMPT = list(range(3, 120))
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True}


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama (2 layers) with tiny K/V, and its tensors."""
    root = tmp_path_factory.mktemp("fp8kv")
    source = build_tiny_checkpoint(root / "source", "LlamaForCausalLM", seed=3)
    state = load_file(str(source / "model.safetensors"))
    factors = {"k_proj": SHRINK, "v_proj": SHRINK, "q_proj": 1 / SHRINK, "o_proj": 1 / SHRINK}
    for name in state:
        part = name.split(".")[-2]
        if part in factors and name.endswith(".weight"):
            state[name] = state[name] * factors[part]
    path = write_checkpoint(source, root / "shrunk", state)
    return Path(path), state


def engine(path: str, **kw) -> LLM:
    return LLM(path, max_model_len=256, kv_cache_memory="4MiB", **kw)


def prompt_logprobs(llm: LLM, prompt: list[int] = PROMPT) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return torch.tensor([e[t].logprob for t, e in zip(prompt[1:], out.prompt_logprobs[1:])])


def scales(llm: LLM) -> list[float]:
    """k_scale, v_scale of layer 0, then of layer 1, ..."""
    return [float(s) for layer in llm.engine.executor.runner.layers
            for s in (layer.k_scale, layer.v_scale)]


def expected_scales(amax: list[tuple[float, float]], fp8_max: float = E4M3_MAX) -> list[float]:
    return [m / fp8_max for pair in amax for m in pair]


def first_step_kv_amax(path: str, prompt: list[int] = PROMPT) -> list[tuple[float, float]]:
    """Per layer, max |K| and max |V| of a prompt's forward through a float32 cache."""
    llm = engine(path)
    seen: list[tuple[float, float]] = []
    hooks = [layer.register_forward_pre_hook(
        lambda _, args: seen.append((float(args[1].abs().max()), float(args[2].abs().max()))))
        for layer in llm.engine.executor.runner.layers]
    prompt_logprobs(llm, prompt)
    for hook in hooks:
        hook.remove()
    return seen


# ---- gating: the core without the plugin -------------------------------------------------------

def test_fp8_kv_cache_without_the_plugin_names_the_package(llama_path, monkeypatch):
    monkeypatch.setenv("HITCHLLM_PLUGINS", "no-such-plugin")  # the core's built-ins only
    assert not get_plugin_registry().pm.hook.hitchllm_kv_cache_scales.get_hookimpls()

    def no_load(*args, **kwargs):
        raise AssertionError("the refusal must come before the model loads")

    with monkeypatch.context() as patch, pytest.raises(
            ValueError, match=r"kv_cache_dtype='fp8_e5m2' needs the hitchllm-quantization "
            r"plugin.*pip install hitchllm-quantization"):
        patch.setattr(worker, "load_model", no_load)
        engine(llama_path, kv_cache_dtype="fp8_e5m2")
    assert engine(llama_path).engine.kv_cache_dtype == torch.float32  # auto needs no plugin


@pytest.mark.parametrize("installed", [True, False])
def test_hitchllm_backends_says_who_serves_fp8_scales(monkeypatch, capsys, installed):
    if not installed:
        monkeypatch.setenv("HITCHLLM_PLUGINS", "no-such-plugin")
    print_backends(None, "cpu", "auto", 16, "fp8")
    out = capsys.readouterr().out
    if installed:
        assert "fp8 KV-cache scales from: hitchllm-quantization " in out
    else:
        assert "engines refuse it; install hitchllm-quantization" in out


def test_the_plugin_implements_the_seam():
    registry = get_plugin_registry()
    impls = registry.pm.hook.hitchllm_kv_cache_scales.get_hookimpls()
    assert [registry.info_for(i.plugin).distribution for i in impls] == ["hitchllm-quantization"]


# ---- scales from the checkpoint ----------------------------------------------------------------

def test_fp8_with_scale_one_loses_tiny_kv_and_checkpoint_scales_recover_it(shrunk, tmp_path):
    path, state = shrunk
    reference = prompt_logprobs(engine(str(path)))
    amax = first_step_kv_amax(str(path))
    plain = prompt_logprobs(engine(str(path), kv_cache_dtype="fp8"))
    # Scales as llm-compressor writes them (shape [1]) for layer 0, as older fp8 checkpoints
    # name them (k_proj/v_proj output_scale, shape []) for layer 1.
    tensors = dict(state)
    k0, v0 = amax[0]
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([k0 / E4M3_MAX])
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([v0 / E4M3_MAX])
    k1, v1 = amax[1]
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor(k1 / E4M3_MAX)
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor(v1 / E4M3_MAX)
    scaled_path = write_checkpoint(path, tmp_path / "scaled", tensors,
                                   {"kv_cache_scheme": KV_SCHEME})
    llm = engine(scaled_path, kv_cache_dtype="fp8")
    assert scales(llm) == pytest.approx(expected_scales(amax), rel=1e-6)
    for layer in llm.engine.executor.runner.layers:
        assert layer.impl.k_scale is layer.k_scale and layer.impl.v_scale is layer.v_scale
    scaled = prompt_logprobs(llm)
    plain_error = (plain - reference).abs().mean()
    scaled_error = (scaled - reference).abs().mean()
    print(f"mean |logprob error|: scale 1.0 {plain_error:.4f}, checkpoint scales "
          f"{scaled_error:.4f}")
    assert plain_error > 0.1  # K/V rounded into fp8's subnormals
    assert scaled_error < plain_error / 5


def test_a_compressed_tensors_checkpoint_that_quantizes_only_its_kv_cache(shrunk, tmp_path):
    """llm-compressor's KV-only checkpoints name the compressed-tensors method with empty
    config_groups: the weights stay float and the checkpoint's scales reach the layers."""
    path, state = shrunk
    amax = first_step_kv_amax(str(path))
    tensors = dict(state)
    for i, (k, v) in enumerate(amax):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([k / E4M3_MAX])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v / E4M3_MAX])
    config = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
              "kv_cache_scheme": KV_SCHEME, "quantization_status": "compressed"}
    llm = engine(write_checkpoint(path, tmp_path / "kv-only", tensors, config),
                 kv_cache_dtype="fp8")
    assert scales(llm) == pytest.approx(expected_scales(amax), rel=1e-6)
    qkv = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float32  # not quantized
    bare = {"quant_method": "compressed-tensors", "config_groups": {}}
    with pytest.raises(ValueError, match="neither config_groups nor a kv_cache_scheme"):
        engine(write_checkpoint(path, tmp_path / "bare", state, bare))


def scale_checkpoint(shrunk, tmp_path, extra: dict[str, torch.Tensor],
                     quantization_config: dict | None = None) -> str:
    path, state = shrunk
    return write_checkpoint(path, tmp_path / "ckpt", {**state, **extra}, quantization_config)


def test_a_scale_with_a_wrong_shape_fails_at_load_naming_the_tensor(shrunk, tmp_path):
    path = scale_checkpoint(shrunk, tmp_path, {
        "model.layers.0.self_attn.k_scale": torch.tensor([0.1, 0.2])})
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.self_attn.k_scale'"
                       r": shape \(2,\) is not a per-tensor KV-cache scale"):
        engine(path, kv_cache_dtype="fp8")


def test_a_non_positive_scale_fails_at_load_naming_the_tensor(shrunk, tmp_path):
    path = scale_checkpoint(shrunk, tmp_path, {
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(0.0)})
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.v_proj.output_scale'.*"
                       "not a positive finite number"):
        engine(path)


def test_scales_with_kv_cache_dtype_auto_are_loaded_unused_and_said_so(shrunk, tmp_path,
                                                                       caplog):
    path = scale_checkpoint(
        shrunk, tmp_path, {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor([0.01])
                           for i in range(2) for w in "kv"},
        {"kv_cache_scheme": KV_SCHEME})
    with caplog.at_level(logging.INFO):
        llm = engine(path)
    assert llm.engine.kv_cache_dtype == torch.float32
    text = caplog.text
    assert "fp8 KV-cache scales (k_scale/v_scale) for 2 attention layers; they are unused " \
           "with kv_cache_dtype=auto" in text
    assert "declares an fp8 KV cache (quantization_config.kv_cache_scheme)" in text
    assert "--kv-cache-dtype fp8" in text


def test_scales_for_some_layers_only_are_refused_with_fp8(shrunk, tmp_path):
    path = scale_checkpoint(shrunk, tmp_path, {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.01),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.01)})
    with pytest.raises(ValueError, match=r"for 1 of 2 attention layers; missing for layers "
                       r"\[1\].*--calculate-kv-scales"):
        engine(path, kv_cache_dtype="fp8")


def test_a_declared_kv_cache_scheme_without_scales_is_refused_with_fp8(shrunk, tmp_path):
    path = scale_checkpoint(shrunk, tmp_path, {}, {"kv_cache_scheme": KV_SCHEME})
    with pytest.raises(ValueError, match=r"declares an fp8 KV cache .* but holds no k_scale"):
        engine(path, kv_cache_dtype="fp8")


def test_a_kv_cache_scheme_other_than_per_tensor_fp8_is_refused(shrunk, tmp_path):
    scheme = {**KV_SCHEME, "num_bits": 4, "type": "int"}
    path = scale_checkpoint(shrunk, tmp_path, {}, {"kv_cache_scheme": scheme})
    with pytest.raises(ValueError, match=r"kv_cache_scheme .* is not supported \(\{'num_bits': "
                       r"4, 'type': 'int'\}\); hitchllm-quantization serves per-tensor fp8"):
        engine(path, kv_cache_dtype="fp8")


def test_without_checkpoint_scales_fp8_uses_one_and_says_so(llama_path, caplog):
    with caplog.at_level(logging.INFO):
        llm = engine(llama_path, kv_cache_dtype="fp8")
    assert set(scales(llm)) == {1.0}
    assert "the checkpoint has no KV-cache scales, so k_scale = v_scale = 1.0" in caplog.text


# ---- calculate_kv_scales -----------------------------------------------------------------------

def test_calculated_scales_come_from_the_first_prompt_served(shrunk):
    path, _ = shrunk
    reference = prompt_logprobs(engine(str(path)))
    amax = first_step_kv_amax(str(path))
    llm = engine(str(path), kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert set(scales(llm)) == {1.0}  # nothing computed while the engine starts
    calculated = prompt_logprobs(llm)
    got = scales(llm)
    # Layer 0's K/V depend on the prompt only; later layers' on the fp8 attention before them.
    assert got[:2] == pytest.approx(expected_scales(amax)[:2], rel=1e-6)
    assert got == pytest.approx(expected_scales(amax), rel=0.05)
    plain = prompt_logprobs(engine(str(path), kv_cache_dtype="fp8"))
    error, plain_error = ((x - reference).abs().mean() for x in (calculated, plain))
    print(f"mean |logprob error|: scale 1.0 {plain_error:.4f}, calculated {error:.4f}")
    assert error < plain_error / 5
    # Computed once: a later, different prompt leaves them alone.
    prompt_logprobs(llm, [5, 9, 200, 7, 3] * 8)
    assert scales(llm) == got


def test_calibration_ignores_the_padding_rows_of_a_padded_step():
    """A step padded for CUDA-graph pieces: the padding rows (here huge) are not the
    prompt's, and the scales come from the real rows only."""
    layer = Attention(4, 8, 2, 8**-0.5, 0)
    calibration = KVScaleCalibration([layer], torch.float8_e4m3fn)
    calibration.arm()
    q, k, v = torch.randn(8, 32), torch.randn(8, 16), torch.randn(8, 16)
    k[5:], v[5:] = 1e4, -1e4
    with set_forward_context(None, split_attention=lambda layer, q, k, v: q,
                             num_real_tokens=5):
        layer(q, k, v)
    assert float(layer.k_scale) == pytest.approx(float(k[:5].abs().max()) / 448.0)
    assert float(layer.v_scale) == pytest.approx(float(v[:5].abs().max()) / 448.0)


def test_calibration_takes_k_and_v_however_the_model_passes_them():
    layers = [Attention(4, 8, 2, 8**-0.5, i) for i in range(2)]
    calibration = KVScaleCalibration(layers, torch.float8_e5m2)
    calibration.arm()
    q = torch.randn(3, 32)
    k, v = torch.randn(3, 16) * 7, torch.zeros(3, 16)
    for layer, call in zip(layers, (lambda f: f(q, k, v), lambda f: f(q, k=k, v=v))):
        with pytest.raises(RuntimeError, match="no backend bound"):  # the hook ran first
            call(layer)
        assert float(layer.k_scale) == pytest.approx(float(k.abs().max()) / 57344.0)
        assert float(layer.v_scale) == 1.0  # an all-zero V has no range to fit
    assert calibration.done
    layers[0].k_scale.fill_(3.0)
    with pytest.raises(RuntimeError):
        layers[0](q, k, v)
    assert float(layers[0].k_scale) == 3.0  # disarmed after its one step


def test_calculated_scales_replace_the_checkpoints(shrunk, tmp_path):
    path = scale_checkpoint(shrunk, tmp_path, {
        f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(0.5) for i in range(2)
        for w in "kv"})
    llm = engine(path, kv_cache_dtype="fp8_e5m2", calculate_kv_scales=True)
    assert set(scales(llm)) == {0.5}
    prompt_logprobs(llm)
    e5m2_max = torch.finfo(torch.float8_e5m2).max
    amax = first_step_kv_amax(path)
    assert scales(llm) == pytest.approx(expected_scales(amax, e5m2_max), rel=0.05)


def test_calculate_kv_scales_needs_an_fp8_cache(llama_path):
    with pytest.raises(EngineConfigError, match="calculate_kv_scales .* kv_cache_dtype is auto"):
        EngineConfig(model=llama_path, calculate_kv_scales=True)


def test_cli_flag_reaches_the_engine_config_and_shows_in_help(capsys):
    args = build_parser().parse_args(["generate", "--kv-cache-dtype", "fp8",
                                      "--calculate-kv-scales", "--prompt", "x"])
    assert engine_kwargs(args)["calculate_kv_scales"] is True
    assert "calculate_kv_scales" not in engine_kwargs(build_parser().parse_args(["generate"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--calculate-kv-scales" in out and "hitchllm-quantization" in out


@pytest.mark.gpu
def test_calculated_scales_ignore_memory_profiling_and_graph_capture_on_cuda(shrunk):
    path, _ = shrunk
    llm = LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8",
              calculate_kv_scales=True, max_model_len=256, gpu_memory_utilization=0.3)
    assert llm.engine.executor.runner.graphs is None or llm.engine.executor.runner.graphs.captured
    assert set(scales(llm)) == {1.0}
    prompt_logprobs(llm)
    assert all(0 < s < 0.01 for s in scales(llm))


# ---- CPU_ATTN reads fp8 like TORCH -------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kv_name", sorted(FP8))
def test_cpu_attn_fp8_equals_torch_fp8_and_float64_over_rounded_kv(case, kv_name):
    cpu_attn = pytest.importorskip("hitchllm_attention_cpu")
    backend = cpu_attn.CpuAttentionBackend
    fp8, model_dtype = FP8[kv_name], torch.float32
    heads, kv_heads, head_size, block_size, num_blocks = 8, 2, 32, 4, 40
    spec = AttentionSpec(device_type="cpu", dtype=model_dtype, kv_cache_dtype=fp8,
                         head_size=head_size, num_heads=heads, num_kv_heads=kv_heads,
                         block_size=block_size)
    assert backend.validate(spec) == []
    kv_spec = KVCacheSpec.for_attention(kv_heads, head_size, fp8, block_size)
    cache = torch.zeros(backend.get_kv_cache_shape_for_spec(num_blocks, kv_spec), dtype=fp8)
    scale = head_size**-0.5
    k_scale, v_scale = 0.01, 0.3
    impls = [b.get_impl_cls()(heads, head_size, scale, kv_heads, spec)
             for b in (backend, TorchAttentionBackend)]
    for impl in impls:
        impl.k_scale, impl.v_scale = torch.tensor(k_scale), torch.tensor(v_scale)
    batch = make_batch(*CASES[case], heads, kv_heads, head_size, block_size, num_blocks, cache,
                       model_dtype, write_context=lambda s, k, v: impls[0].write_kv_cache(
                           cache, k, v, s))
    outs = []
    for b, impl in zip((backend, TorchAttentionBackend), impls):
        meta = b.get_builder_cls()(spec, torch.device("cpu")).build(batch.common)
        outs.append(impl.forward(batch.query, batch.key, batch.value, cache, meta))
        if b is backend:
            assert meta.kernel is not None  # the C kernel read the fp8 cache
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
    rounded = dataclasses.replace(
        batch,
        full_keys=[fp8_rounded(k, k_scale, model_dtype, fp8) for k in batch.full_keys],
        full_values=[fp8_rounded(v, v_scale, model_dtype, fp8) for v in batch.full_values])
    torch.testing.assert_close(outs[0].double(), reference_attention(rounded, scale,
                                                                     dtype=torch.float64),
                               atol=2e-5, rtol=2e-5)


def test_cpu_attn_engine_with_fp8_follows_torch_fp8(shrunk):
    pytest.importorskip("hitchllm_attention_cpu")
    path, _ = shrunk
    runs = {}
    for name in ("TORCH", "CPU_ATTN"):
        llm = engine(str(path), kv_cache_dtype="fp8", calculate_kv_scales=True,
                     attention_backend=name)
        assert llm.engine.attention_backend.name == name
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": PROMPT[:40]}, {"prompt_token_ids": [4, 5]}],
                            params, use_tqdm=False)
        runs[name] = ([o.outputs[0].token_ids for o in outs],
                      [lp[t].logprob for o in outs
                       for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
                      scales(llm))
    assert runs["CPU_ATTN"][0] == runs["TORCH"][0]
    assert runs["CPU_ATTN"][2] == pytest.approx(runs["TORCH"][2], rel=1e-5)
    torch.testing.assert_close(torch.tensor(runs["CPU_ATTN"][1]), torch.tensor(runs["TORCH"][1]),
                               atol=1e-4, rtol=1e-4)


class AutoOnlyBackend(TorchAttentionBackend):
    """Ranked above every backend, but reads K/V in the model dtype only."""

    name = "MODEL_DTYPE_ONLY"
    priority = 1000

    @classmethod
    def validate(cls, spec):
        return kernel_reasons(spec, dtypes=(torch.float32,))


class AutoOnlyPlugin:
    @hookimpl
    def hitchllm_attention_backends(self):
        return [AutoOnlyBackend]


def test_auto_mode_passes_over_a_backend_that_refuses_fp8(llama_path, auto_backend,
                                                          monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # as on a CPU machine: TRITON_ATTN refuses the CPU
    get_plugin_registry().pm.register(AutoOnlyPlugin(), name="model-dtype-only")
    assert engine(llama_path).engine.attention_backend is AutoOnlyBackend
    fp8 = engine(llama_path, kv_cache_dtype="fp8").engine.attention_backend
    assert fp8 is not AutoOnlyBackend and fp8.name in ("CPU_ATTN", "TORCH")


def test_auto_mode_serves_fp8_on_cpu_with_cpu_attn(llama_path, auto_backend, monkeypatch):
    pytest.importorskip("hitchllm_attention_cpu")
    monkeypatch.delenv("TRITON_INTERPRET")  # as on a CPU machine: TRITON_ATTN refuses the CPU
    llm = engine(llama_path, kv_cache_dtype="fp8")
    assert llm.engine.attention_backend.name == "CPU_ATTN"
    assert llm.engine.executor.runner.kv_caches[0].dtype == torch.float8_e4m3fn


# ---- the doubled block count -------------------------------------------------------------------

def test_fp8_doubles_the_blocks_of_bfloat16_in_the_start_up_log(llama_path, caplog):
    counts = {}
    for kv in ("auto", "fp8"):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            llm = LLM(llama_path, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory="1MiB",
                      max_model_len=64)
        [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
        counts[kv] = int(line.split()[2])
        assert counts[kv] == llm.engine.num_kv_blocks
        assert line.endswith("KV cache " + ("bfloat16" if kv == "auto" else "float8_e4m3fn"))
    assert counts["fp8"] == 2 * counts["auto"]
