"""Appending a benchmark's table to a Markdown results file (``--results``)."""

from __future__ import annotations

import os
import subprocess
from datetime import date
from pathlib import Path

from hitchllm.entrypoints.machine import describe_machine


def current_commit() -> str:
    """The commit the results come from: ``HITCHLLM_COMMIT`` when set (a copy of the tree whose
    git metadata is not its own, as on a lent GPU machine), else ``git rev-parse`` with
    ``+changes`` when tracked files differ from it."""
    named = os.environ.get("HITCHLLM_COMMIT")
    if named:
        return named

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False,
                              cwd=Path(__file__).parent).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return commit


def entry_heading(title: str, command: str, note: str = "") -> list[str]:
    """The first lines of an entry: ``### title (date, machine, commit abc1234)``, a blank
    line, ``command`` in backticks followed by ``note``, a blank line."""
    commit = current_commit()
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
