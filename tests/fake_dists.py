"""Install throwaway plugin distributions on ``sys.path`` (a ``.dist-info`` folder with an
entry point), the way ``pip install`` would, without installing anything."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest


def install_fake_plugin(
    root: Path, monkeypatch: pytest.MonkeyPatch, dist: str, version: str, module: str,
    source: str, entry_point: str | None = None,
) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        f"[hitchllm.plugins]\n{entry_point or module} = {module}\n"
    )
    monkeypatch.syspath_prepend(str(root))
