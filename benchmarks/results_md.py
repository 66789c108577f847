"""Appending a benchmark's table to a Markdown results file (``--results``)."""

from __future__ import annotations

import subprocess
from datetime import date
from pathlib import Path

from hitchllm.entrypoints.machine import describe_machine


def entry_heading(title: str, command: str, note: str = "") -> list[str]:
    """The first lines of an entry: ``### title (date, machine, commit abc1234)``, a blank
    line, ``command`` in backticks followed by ``note``, a blank line."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    return [f"### {title} ({date.today()}, {describe_machine()}, commit {commit})", "",
            f"`{command}`" + (f" {note}" if note else ""), ""]


def append_results(path: Path, lines: list[str], section: str | None = None,
                   about: str = "") -> None:
    """Append ``lines`` to ``path``; first ``section`` and ``about`` when ``path`` does not
    hold ``section`` yet."""
    known = path.read_text() if section and path.exists() else ""
    with path.open("a") as f:
        if section and section not in known:
            f.write(f"\n{section}\n\n{about}\n")
        f.write("\n" + "\n".join(lines) + "\n")
