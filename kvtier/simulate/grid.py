"""Grids of config overrides: ``host.capacity=1GiB,4GiB backends[0].options.capacity=50GiB,200GiB``.

Each ``--grid`` argument is ``PATH=V1,V2,...`` with ``PATH`` a config key path as error messages print
it (dots between keys, ``[i]`` for list entries); the points are every combination (first key varies
slowest).  Values are read as YAML, like environment overrides, and each point is validated as a whole
config before anything runs, so a bad key or value is reported with the ``--grid`` argument that set it.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..config import ENV_PREFIX, ConfigError, KvtierConfig, config_text, parse_config, read_yaml

_SEG = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)")


@dataclass(frozen=True)
class GridAxis:
    path: str                  # as the user wrote it, e.g. "backends[0].options.capacity"
    values: tuple[str, ...]

    @property
    def env_var(self) -> str:
        """The environment override that sets the same key (the config loader's one way to set a path)."""
        segs: list[str] = []
        for part in self.path.split("."):
            m = _SEG.fullmatch(part)
            if m is None:
                raise ValueError(f"--grid {self.path}: {part!r} is not a key name (keys are separated by '.', "
                                 "list entries written [i], e.g. backends[0].options.capacity)")
            segs.append(m.group(1))
            segs += re.findall(r"\d+", m.group(2))
        return ENV_PREFIX + "__".join(s.upper() for s in segs)


def parse_axes(args: Sequence[str]) -> list[GridAxis]:
    """``["host.capacity=1GiB,4GiB", ...]`` -> axes; ValueError naming the bad argument."""
    axes: list[GridAxis] = []
    for a in args:
        path, eq, vals = a.partition("=")
        path = path.strip()
        values = tuple(v.strip() for v in vals.split(","))
        if not eq or not path or not all(values):
            raise ValueError(f"--grid {a!r}: expected PATH=V1,V2,... (e.g. host.capacity=1GiB,4GiB)")
        if any(x.path == path for x in axes):
            raise ValueError(f"--grid {path}: given twice; list all its values in one argument")
        axis = GridAxis(path, values)
        axis.env_var  # noqa: B018 - validates the path's syntax now
        axes.append(axis)
    return axes


@dataclass(frozen=True)
class GridPoint:
    values: dict[str, str]     # axis path -> value at this point
    config: KvtierConfig

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.values.items()) or "(config as written)"


def grid_points(config_path: str | os.PathLike[str] | None, axes: Sequence[GridAxis],
                env: Mapping[str, str] | None = None) -> list[GridPoint]:
    """Every point of the grid over ``config_path`` (None: the embedded default config), validated.
    ``env``: the environment's ``KVTIER_*`` overrides apply under the grid's (default ``os.environ``)."""
    source, text = config_text(config_path)
    data = read_yaml(text, source)
    base = {k: v for k, v in (os.environ if env is None else env).items() if k.startswith(ENV_PREFIX)}
    names = {a.env_var: a.path for a in axes}
    points = []
    for combo in itertools.product(*(a.values for a in axes)):
        values = {a.path: v for a, v in zip(axes, combo)}
        over = dict(base)
        over.update({a.env_var: v for a, v in zip(axes, combo)})
        try:
            cfg = parse_config(data, source=source, env=over)
        except ConfigError as e:
            lines = [_as_grid(line, names) for line in e.problems]
            raise ConfigError(lines, source) from None
        points.append(GridPoint(values, cfg))
    return points


def _as_grid(line: str, names: Mapping[str, str]) -> str:
    """Say ``--grid PATH`` where the config loader names the environment variable it set."""
    for var, path in names.items():
        if line.startswith(var + ": "):
            line = f"--grid {path}: " + line[len(var) + 2:]
        line = line.replace(f"environment variable {var}", f"--grid {path}")
    return line


__all__ = ["GridAxis", "GridPoint", "grid_points", "parse_axes"]
