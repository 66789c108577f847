"""docs/plugins.md's example package works as written.

The files of the example (fenced blocks with a ``title="..."`` info string) are extracted from
the guide and made visible as an installed distribution (a ``.dist-info`` generated from the
example's own pyproject.toml, as ``pip install -e .`` would). Then the backend must be listed,
be forceable by name, and give the same greedy tokens as TORCH.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hitchllm import LLM, SamplingParams, hookspecs
from hitchllm.attention import AttentionSpec, CommonAttentionMetadata
from hitchllm.attention.selector import (
    AttentionBackendError,
    rank_backends,
    select_attention_backend,
)
from hitchllm.entrypoints.cli import main as cli_main

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
# ```python title="pkg/mod.py" ... ``` -- the closing fence has the opening fence's length, so a
# README block may hold ``` fences of its own inside a ```` fence.
TITLED_BLOCK = re.compile(
    r'^(?P<fence>`{3,})[\w-]+ title="(?P<path>[^"]+)"\n(?P<body>.*?)^(?P=fence)[ \t]*$',
    re.MULTILINE | re.DOTALL,
)
EXAMPLE_FILES = {
    "pyproject.toml",
    "README.md",
    "hitchllm_attention_example/__init__.py",
    "hitchllm_attention_example/backend.py",
    "tests/test_matches_torch.py",
}
NAME = "EXAMPLE_SDPA"
DIST = "hitchllm-attention-example"
SPEC = AttentionSpec(device_type="cpu", dtype=torch.float32, kv_cache_dtype=torch.float32,
                     head_size=16, num_heads=4, num_kv_heads=2, block_size=4)

pytestmark = pytest.mark.usefixtures("auto_backend")


def guide_files() -> dict[str, str]:
    files = {m["path"]: m["body"] for m in TITLED_BLOCK.finditer(GUIDE.read_text())}
    assert set(files) == EXAMPLE_FILES, "docs/plugins.md's example files changed; update the test"
    return files


def write_dist_info(project_dir: Path) -> tuple[str, str]:
    """What ``pip install -e .`` leaves behind for entry-point discovery, from pyproject.toml."""
    project = tomllib.loads((project_dir / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    entry_points = project["entry-points"]["hitchllm.plugins"]
    info = project_dir / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = [f"{ep} = {target}" for ep, target in entry_points.items()]
    (info / "entry_points.txt").write_text("[hitchllm.plugins]\n" + "\n".join(lines) + "\n")
    return name, version


@pytest.fixture
def example(tmp_path, monkeypatch) -> Path:
    """The guide's example package, written out and visible as an installed distribution."""
    root = tmp_path / DIST
    for rel, body in guide_files().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    assert write_dist_info(root) == (DIST, "0.1.0")
    monkeypatch.syspath_prepend(str(root))
    # The guide describes a machine with the core and this plugin only; other installed
    # plugins (e.g. TRITON_ATTN) would change what auto mode picks.
    monkeypatch.setenv("HITCHLLM_PLUGINS", DIST)
    yield root
    for mod in [m for m in sys.modules if m.startswith("hitchllm_attention_example")]:
        del sys.modules[mod]


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"guide_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_guide_documents_every_hook():
    hooks = [name for name in vars(hookspecs) if name.startswith("hitchllm_")]
    table_rows = {m[1] for m in re.finditer(r"^\| `(hitchllm_\w+)` \|", GUIDE.read_text(),
                                            re.MULTILINE)}
    assert hooks and set(hooks) == table_rows, "update the hook table in docs/plugins.md"


def test_guide_documents_every_spec_and_metadata_field():
    first_cells = [line.split("|")[1] for line in GUIDE.read_text().splitlines()
                   if line.startswith("| ")]
    documented = {name for cell in first_cells for name in re.findall(r"`(\w+)`", cell)}
    for cls in (AttentionSpec, CommonAttentionMetadata):
        missing = {f.name for f in dataclasses.fields(cls)} - documented
        assert not missing, f"docs/plugins.md does not document {cls.__name__}.{missing}"


def test_example_backend_is_listed_valid_from_its_distribution_but_not_auto_picked(example):
    [candidate] = [c for c in rank_backends(SPEC) if c.name == NAME]
    assert candidate.valid, candidate.reasons
    assert (candidate.source.distribution, candidate.source.version) == (DIST, "0.1.0")
    assert candidate.backend.priority < 0  # the guide: installing it never changes auto mode
    assert select_attention_backend(SPEC).name == "TORCH"


def test_backends_cli_shows_the_example(example, llama_path, capsys):
    assert cli_main(["backends", "--model", llama_path, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^{NAME}\s+-?\d+\s+{DIST} 0\.1\.0\s+yes$", out, re.MULTILINE), out
    assert "auto mode picks: TORCH" in out


def test_forcing_with_vllm_env_var_uses_the_example_and_matches_torch(
    example, monkeypatch, llama_path
):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", NAME.lower())
    assert select_attention_backend(SPEC).name == NAME
    prompts = ["Hi", "def add(a, b):\n    return a + b", "The quick brown fox jumps " * 4]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for forced in (None, "TORCH"):  # None: the environment variable decides
        llm = LLM(llama_path, attention_backend=forced, block_size=4)
        tokens[llm.engine.attention_backend.name] = [
            out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert set(tokens) == {NAME, "TORCH"}
    assert tokens[NAME] == tokens["TORCH"]
    assert all(len(t) == 8 for t in tokens[NAME])


def test_forced_example_quotes_its_reasons(example):
    soft_capped = AttentionSpec(**{**SPEC.__dict__, "logits_soft_cap": 30.0})
    with pytest.raises(AttentionBackendError, match=rf"{NAME} \(from {DIST}\).*soft-cap"):
        select_attention_backend(soft_capped, forced=NAME)


def test_guide_test_sketch_passes(example, tmp_path):
    """The example's own test (chunked prefill, mixed batches, prefix-cache hits) as written."""
    sketch = load_module(example / "tests" / "test_matches_torch.py")
    sketch.test_example_backend_matches_torch(tmp_path)


def test_example_impl_skips_padding_slots_and_matches_torch_impl(example):
    """Layer level: one request with 3 cached tokens and 3 new ones, the last slot -1."""
    heads, kv_heads, d, block_size = SPEC.num_heads, SPEC.num_kv_heads, SPEC.head_size, 4
    backends = {name: select_attention_backend(SPEC, forced=name) for name in (NAME, "TORCH")}
    caches = {name: torch.zeros(b.get_kv_cache_shape(6, block_size, kv_heads, d))
              for name, b in backends.items()}
    # Positions 0..2 are cached in block 4; the step adds position 3 (block 4, slot 19),
    # position 4 (block 1, slot 4) and position 5, whose slot is -1 (not written).
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([6], dtype=torch.int32),
        num_computed_tokens_cpu=torch.tensor([3], dtype=torch.int32),
        block_table=torch.tensor([[4, 1]], dtype=torch.int32),
        slot_mapping=torch.tensor([19, 4, -1]),
        num_reqs=1, num_actual_tokens=3, max_query_len=3, max_seq_len=6)
    g = torch.Generator().manual_seed(0)
    context_k, context_v, k, v = torch.randn(4, 3, kv_heads, d, generator=g)
    q = torch.randn(3, heads, d, generator=g)
    caches[NAME][4, 0, :3], caches[NAME][4, 1, :3] = context_k, context_v  # its own layout
    # TORCH is head-major: [k/v, kv_head, block, offset, d].
    caches["TORCH"][0, :, 4, :3] = context_k.transpose(0, 1)
    caches["TORCH"][1, :, 4, :3] = context_v.transpose(0, 1)

    out = {}
    for name, backend in backends.items():
        impl = backend.get_impl_cls()(heads, d, d**-0.5, kv_heads, SPEC)
        meta = backend.get_builder_cls()(SPEC, torch.device("cpu")).build(common)
        out[name] = impl.forward(q, k, v, caches[name], meta)
    torch.testing.assert_close(out[NAME], out["TORCH"])
    cache = caches[NAME]
    written = cache.abs().sum(dim=(1, 3, 4)).nonzero().tolist()  # [block, offset] pairs
    assert written == [[1, 0], [4, 0], [4, 1], [4, 2], [4, 3]]
    torch.testing.assert_close(cache[4, 0, 3], k[0])
    torch.testing.assert_close(cache[1, 1, 0], v[1])
