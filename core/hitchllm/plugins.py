"""Plugin discovery: one pluggy ``PluginManager`` per process, fed by entry points.

Plugins are found through the entry-point group ``hitchllm.plugins``. A plugin that fails to
import is recorded (distribution, version, error), logged, and skipped: a broken optional
plugin must never take the engine down. ``HITCHLLM_PLUGINS=name1,name2`` restricts which entry
points load (matched against the entry point name or its distribution name).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import pluggy

try:  # the backport tracks newer entry-point behaviour; the stdlib module is enough otherwise
    import importlib_metadata
except ImportError:  # pragma: no cover - depends on the environment
    import importlib.metadata as importlib_metadata  # type: ignore[no-redef]

from hitchllm import hookspecs

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hitchllm.plugins"
PROJECT = "hitchllm"
BUILTIN_DISTRIBUTION = "hitchllm"

hookimpl = hookspecs.hookimpl


@dataclass(frozen=True)
class PluginInfo:
    """Where one registered (or failed) plugin comes from."""

    name: str
    distribution: str
    version: str
    error: str | None = None


class PluginRegistry:
    """The process's plugin manager plus a record of what was loaded and what failed."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.loaded: dict[str, PluginInfo] = {}
        self.failed: list[PluginInfo] = []
        self._register_builtins()
        self._load_entry_points()

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def info_for(self, plugin: object) -> PluginInfo:
        """The PluginInfo of a registered plugin object."""
        name = self.pm.get_name(plugin)
        return self.loaded.get(name or "", PluginInfo(str(name), "unknown", "unknown"))

    def _register_builtins(self) -> None:
        from hitchllm import builtins

        version = _version_of(BUILTIN_DISTRIBUTION)
        self.pm.register(builtins, name="hitchllm.builtins")
        self.loaded["hitchllm.builtins"] = PluginInfo(
            "hitchllm.builtins", BUILTIN_DISTRIBUTION, version
        )

    def _load_entry_points(self) -> None:
        allow = _allow_list()
        seen: set[str] = set()
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "unknown"
            version = ep.dist.version if ep.dist is not None else "unknown"
            if allow is not None and ep.name not in allow and dist not in allow:
                continue
            if ep.name in seen or self.pm.has_plugin(ep.name):
                continue
            seen.add(ep.name)
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
                self._check_hook_names(ep.name, plugin)
            except Exception as exc:  # a broken plugin is reported, never fatal
                err = f"{type(exc).__name__}: {exc}"
                self.failed.append(PluginInfo(ep.name, dist, version, err))
                logger.warning(
                    "hitchllm plugin %r from %s %s failed to load and is skipped: %s",
                    ep.name, dist, version, err,
                )
                continue
            self.loaded[ep.name] = PluginInfo(ep.name, dist, version)


    def _check_hook_names(self, name: str, plugin: object) -> None:
        """A misspelled hook would otherwise be silently never called: reject the plugin."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            self.pm.unregister(plugin, name=name)
            raise


def _allow_list() -> set[str] | None:
    raw = os.environ.get("HITCHLLM_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _version_of(distribution: str) -> str:
    try:
        return importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


_registry: PluginRegistry | None = None
_lock = threading.Lock()


def get_plugin_registry() -> PluginRegistry:
    """The process-wide registry; discovery runs on first use."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = PluginRegistry()
        return _registry


def reset_plugin_registry() -> None:
    """Forget the registry so the next use rediscovers plugins (tests, HITCHLLM_PLUGINS change)."""
    global _registry
    with _lock:
        _registry = None

