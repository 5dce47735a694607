"""Entry-point registry: backends and policies are found by name in installed distributions.

The built-ins register through kvtier's own ``pyproject.toml`` entry points, exactly as a third-party
package would; nothing is special-cased here.  A plugin that fails to import produces an error naming it
and its distribution, and leaves every other plugin usable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

M = TypeVar("M")

GROUPS = {
    "backend": "kvtier.backends",
    "write_policy": "kvtier.write_policies",
    "prefetch_policy": "kvtier.prefetch_policies",
    "eviction_policy": "kvtier.eviction_policies",
}


class PluginError(ValueError):
    """A plugin could not be found or loaded.  The message names the plugin and what is available."""


@dataclass(frozen=True)
class PluginInfo:
    group: str
    name: str
    value: str
    distribution: str
    version: str


@functools.cache
def _entry_points(group: str) -> tuple[metadata.EntryPoint, ...]:
    # Scanning every installed distribution costs ~10 ms; a config names several plugins.  Packages
    # installed after the first lookup are seen after ``refresh()``.
    return tuple(sorted(metadata.entry_points(group=group), key=lambda ep: ep.name))


def refresh() -> None:
    """Forget the cached entry points (after installing a plugin package into a running process)."""
    _entry_points.cache_clear()


def _dist(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"], dist.version


def available(kind: str | None = None) -> list[PluginInfo]:
    """Every registered plugin (of one kind: "backend", "write_policy", ...), without importing it."""
    kinds = [kind] if kind else list(GROUPS)
    out = []
    for k in kinds:
        group = _group(k)
        for ep in _entry_points(group):
            dname, ver = _dist(ep)
            out.append(PluginInfo(group, ep.name, ep.value, dname, ver))
    return out


def names(kind: str) -> list[str]:
    return sorted({p.name for p in available(kind)})


def load(kind: str, name: str) -> Any:
    """The object registered as ``name`` in ``kind``'s group; PluginError otherwise."""
    group = _group(kind)
    matches = [ep for ep in _entry_points(group) if ep.name == name]
    if not matches:
        have = ", ".join(names(kind)) or "(none installed)"
        raise PluginError(f"unknown {kind.replace('_', ' ')} {name!r}; available: {have}")
    ep = matches[0]
    try:
        return ep.load()
    except Exception as e:  # noqa: BLE001 - any import failure is reported the same way
        dname, ver = _dist(ep)
        raise PluginError(f"{kind.replace('_', ' ')} plugin {name!r} ({ep.value}) from distribution "
                          f"{dname} {ver} failed to import: {type(e).__name__}: {e}") from e


@functools.cache
def strict_options(model: type[M]) -> type[M]:
    """The model kvtier validates a plugin's ``options`` with: ``model`` itself when it forbids unknown
    keys (kvtier's own bases do) or explicitly allows them (``extra="allow"``: the plugin keeps them), else
    a subclass that forbids them.  Pydantic's default is to drop an unknown key silently, so a plain
    ``BaseModel`` would turn a mistyped option into its default without a word."""
    from pydantic import BaseModel, ConfigDict

    if not (isinstance(model, type) and issubclass(model, BaseModel)) or \
            model.model_config.get("extra") in ("forbid", "allow"):
        return model
    # Same name, module and docs: errors, schemas and reprs read as the plugin's own model.
    return type(model.__name__, (model,), {"model_config": ConfigDict(extra="forbid"), "__doc__": model.__doc__,
                                           "__module__": model.__module__, "__qualname__": model.__qualname__})


def _group(kind: str) -> str:
    if kind in GROUPS:
        return GROUPS[kind]
    if kind in GROUPS.values():
        return kind
    raise ValueError(f"unknown plugin kind {kind!r}; expected one of {', '.join(GROUPS)}")
