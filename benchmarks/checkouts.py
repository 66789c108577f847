"""Comparing hitchllm checkouts in interleaved rounds (``--trees LABEL=DIR,...``), shared by
the CPU benchmarks that time a change against another checkout on a machine other processes
share (benchmarks/startup_cpu.py, benchmarks/prefill_cpu.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_trees_argument(parser: argparse.ArgumentParser) -> None:
    """``--trees``, by default only the checkout this script belongs to."""
    parser.add_argument("--trees", default=f"this={Path(__file__).resolve().parents[1]}",
                        help="LABEL=DIR checkouts to compare, comma-separated (default: this "
                             "one)")


def parse_trees(parser: argparse.ArgumentParser, spec: str) -> dict[str, Path]:
    """``LABEL=DIR,...`` as labels to checkout directories (a parser error names a bad one)."""
    trees: dict[str, Path] = {}
    for item in spec.split(","):
        label, sep, directory = item.partition("=")
        if not sep or not (Path(directory) / "core" / "hitchllm").is_dir():
            parser.error(f"--trees: {item!r} is not LABEL=DIR with DIR a hitchllm checkout")
        trees[label] = Path(directory).resolve()
    return trees


def tree_pythonpath(tree: Path) -> str:
    """The import path of a checkout: its core and every plugin directory."""
    plugins = sorted(p for p in (tree / "plugins").iterdir() if p.is_dir())
    return os.pathsep.join(str(p) for p in [tree / "core", *plugins])


def command_line(script: str, argv: list[str]) -> str:
    """The command that ran ``script`` with ``argv``, less its ``--results FILE``."""
    kept = [a for i, a in enumerate(argv)
            if a != "--results" and (i == 0 or argv[i - 1] != "--results")]
    return " ".join([f"python benchmarks/{script}", *kept])
