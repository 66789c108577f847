"""Choosing an attention backend: auto (highest-priority valid) or forced by name.

Forcing, in order of precedence: the ``attention_backend`` engine argument (CLI
``--attention-backend``), then ``HITCHLLM_ATTENTION_BACKEND``, then ``VLLM_ATTENTION_BACKEND``.
A forced backend that cannot serve raises with its reasons; an unknown name raises with the
installed names. There is never a silent fallback.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from hitchllm.attention.backend import AttentionBackend, AttentionSpec
from hitchllm.plugins import PluginInfo, PluginRegistry, get_plugin_registry

logger = logging.getLogger(__name__)

FORCE_ENV_VARS = ("HITCHLLM_ATTENTION_BACKEND", "VLLM_ATTENTION_BACKEND")


class AttentionBackendError(ValueError):
    """No backend can be used as asked; the message says why and what to change."""


@dataclass(frozen=True)
class BackendCandidate:
    """A discovered backend, where it comes from, and whether it can serve a spec."""

    backend: type[AttentionBackend]
    source: PluginInfo
    reasons: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def valid(self) -> bool:
        return not self.reasons


def discover_backends(registry: PluginRegistry | None = None) -> list[tuple[type, PluginInfo]]:
    """Every backend class offered through ``hitchllm_attention_backends``, with its plugin.

    Hook implementations are called one by one so each backend can be attributed to its
    distribution. If two plugins offer the same name, the one registered last wins.
    """
    registry = registry or get_plugin_registry()
    found: dict[str, tuple[type, PluginInfo]] = {}
    # get_hookimpls() lists in registration order; walk it backwards so that, like pluggy's
    # own call order, the plugin registered last is seen (and kept) first.
    for impl in reversed(registry.pm.hook.hitchllm_attention_backends.get_hookimpls()):
        info = registry.info_for(impl.plugin)
        try:
            backends = impl.function() or []
        except Exception as exc:  # a plugin's hook failing must not hide the others
            logger.warning("plugin %s failed listing attention backends: %s", info.name, exc)
            continue
        for backend in backends:
            name = backend.name.upper()
            if name in found:
                logger.warning(
                    "attention backend %s is offered by both %s and %s; using %s",
                    name, found[name][1].distribution, info.distribution,
                    found[name][1].distribution,
                )
                continue
            found[name] = (backend, info)
    return list(found.values())


def rank_backends(
    spec: AttentionSpec, registry: PluginRegistry | None = None
) -> list[BackendCandidate]:
    """All backends, best first: valid before invalid, then by priority, then by name."""
    candidates = []
    for backend, info in discover_backends(registry):
        try:
            reasons = tuple(backend.validate(spec))
        except Exception as exc:
            reasons = (f"validate() raised {type(exc).__name__}: {exc}",)
        candidates.append(BackendCandidate(backend, info, reasons))
    candidates.sort(key=lambda c: (not c.valid, -c.backend.priority, c.name))
    return candidates


def forced_backend_name(explicit: str | None = None) -> str | None:
    """The backend name the user forced, if any (argument first, then environment)."""
    if explicit:
        return explicit.strip().upper()
    for var in FORCE_ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            return value.upper()
    return None


def select_attention_backend(
    spec: AttentionSpec, forced: str | None = None, registry: PluginRegistry | None = None
) -> type[AttentionBackend]:
    """The backend to use for ``spec``: the forced one (validated) or the best valid one."""
    registry = registry or get_plugin_registry()
    candidates = rank_backends(spec, registry)
    name = forced_backend_name(forced)
    if name is not None:
        match = next((c for c in candidates if c.name == name), None)
        if match is None:
            raise AttentionBackendError(_unknown_backend_message(name, candidates, registry))
        if not match.valid:
            raise AttentionBackendError(
                f"attention backend {name} (from {match.source.distribution}) was forced but "
                f"cannot serve this model on this device: {'; '.join(match.reasons)}. "
                "Unset the forcing (attention_backend= / --attention-backend / "
                "HITCHLLM_ATTENTION_BACKEND / VLLM_ATTENTION_BACKEND) or pick another backend."
            )
        return match.backend
    valid = [c for c in candidates if c.valid]
    if not valid:
        lines = "\n".join(f"  {c.name} ({c.source.distribution}): {'; '.join(c.reasons)}"
                          for c in candidates)
        raise AttentionBackendError(f"no attention backend can serve this model:\n{lines}")
    return valid[0].backend


def _unknown_backend_message(
    name: str, candidates: list[BackendCandidate], registry: PluginRegistry
) -> str:
    installed = ", ".join(f"{c.name} ({c.source.distribution} {c.source.version})"
                          for c in candidates) or "none"
    msg = f"unknown attention backend {name!r}. Installed backends: {installed}."
    if registry.failed:
        broken = "; ".join(f"{f.name} ({f.distribution} {f.version}): {f.error}"
                           for f in registry.failed)
        msg += f" Plugins that failed to load: {broken}."
    return msg
