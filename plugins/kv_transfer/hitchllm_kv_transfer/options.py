"""Checking a connector's ``kv_connector_extra_config`` at start-up."""

from __future__ import annotations

from typing import Any


def check_options(connector: str, options: dict[str, Any],
                  known: dict[str, type | tuple[type, ...]]) -> None:
    """``ValueError`` naming an unknown option or one of the wrong type."""
    for key, value in options.items():
        if key not in known:
            raise ValueError(f"kv_connector_extra_config: {connector} has no option {key!r}; "
                             f"its options are {', '.join(sorted(known))}")
        if not isinstance(value, known[key]) or isinstance(value, bool):
            raise ValueError(f"kv_connector_extra_config.{key} of {connector} has the wrong "
                             f"type ({type(value).__name__}: {value!r})")
