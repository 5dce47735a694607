"""What ``kvtier inspect``, ``kvtier verify`` and ``kvtier gc`` share: loading the config, opening its
backends, reading namespace manifests, progress bars, and keeping secrets out of the output.

Invariants:
* A tool opens each backend with its ``capacity`` option (if it has one) lifted: ``local_disk`` re-applies
  its bound when it opens, and a read-only tool must not evict, nor may ``gc`` evict where it cannot
  report.  ``gc`` applies the configured capacity itself (``StorageBackend.evict_to``).
* A backend that cannot be opened or read is reported by name and the tool goes on with the others; a
  ``path`` option naming nothing is such an error (opening would create the directory).
* The config is loaded as the process that uses it loads it (``--engine``): a YAML whose model section vLLM
  or SGLang fills (absent or incomplete) is validated with placeholders for what the engine fills.
* A tool works on the config's own namespaces only (``Scope``), unless told ``--all-namespaces``: in a
  store two deployments share, one's tools neither list the other's model nor read, verify or evict its
  blocks.  Its own: the config's namespace id, and every namespace whose manifest names the same model
  and layout (its other TP / PP ranks and KV cache groups, a run under another hash seed).  An engine YAML
  has no namespace id until the engine runs: its own are those whose manifest matches the model fields
  the file sets, and one that sets no ``model.id`` is refused (exit 2) without ``--all-namespaces``.  A
  namespace without a manifest is nobody's but the config's whose id it is.
* Nothing printed holds a password: URLs are printed from the validated options (the redis backend has
  already moved the password out of its URL) and every message passes through ``mask_secrets``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ...backend_api import StorageBackend
from ...config import ENGINES, BackendConfig, ConfigError, KvtierConfig, ModelSection, load_config_as_deployed
from ...format.blockformat import HEADER_SIZE
from ...keys import Namespace
from ...units import format_size
from ..cli import UserError

UNBOUNDED = 2**63 - 1
_URL_PASSWORD = re.compile(r"(://[^/@\s:]*:)[^/@\s]*@")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
_LAYOUT_FIELD = struct.Struct("<I")  # stored block format v1: layout id at offset 68 (kvtier.format.blockformat)
_LAYOUT_OFFSET = 68


def mask_secrets(text: str) -> str:
    """``text`` with any ``scheme://user:password@`` password replaced by ``***``."""
    return _URL_PASSWORD.sub(r"\1***@", text)


ENGINE_CHOICES = ("auto", *ENGINES, "none")


def add_engine_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=ENGINE_CHOICES, default="auto",
                   help="who loads the YAML: vllm / sglang fill its model section at start-up, so the file "
                        "may leave it out (the fields it leaves are checked with placeholders); none: kvtier "
                        "alone (kvtier run, pd), the file needs a complete model section; auto (default): an "
                        "engine's YAML when its model section is absent or incomplete")


def engine_label(engine: str) -> str:
    """Who fills an engine YAML's model section: the engine named, or either under ``--engine auto``."""
    return " / ".join(ENGINES) if engine == "auto" else engine


def engine_model_line(cfg: KvtierConfig, engine: str, filled: list[str]) -> str:
    """``model: filled by the engine (vllm / sglang) at start-up; this file sets model.id = ...``"""
    sets = [f"model.{k} = {getattr(cfg.model, k)}" for k in ModelSection.model_fields if k not in filled]
    told = ", ".join(sets) if sets else \
        "none of them (model.id, which names the namespace, will be the engine's model name)"
    return f"model: filled by the engine ({engine_label(engine)}) at start-up; this file sets {told}"


def engine_tiers(cfg: KvtierConfig, engine: str) -> str:
    """The tiers of an engine YAML, fastest first: the device (and under SGLang the host memory) is the
    engine's own; ``KvtierConfig.summary`` would describe kvtier's standalone pool instead."""
    if engine == "sglang":
        tiers = ["device and host (SGLang's own: --hicache-size / --hicache-ratio)"]
    else:
        host = cfg.host.capacity
        who = "vLLM" if engine == "vllm" else "the engine"
        per = " per worker" if engine == "vllm" else " per vLLM worker (SGLang keeps its own)"
        tiers = [f"device ({who}'s KV cache)", f"host {format_size(host)}{per}" if host else "host off"]
    tiers += [f"{b.name} ({b.type}{'' if b.write else ', read-only'})" for b in cfg.backends]
    tail = "; values keep the engine's own arrangement where it is vLLM CPU's" \
        if cfg.storage.payload == "engine" and engine != "sglang" else ""
    return " -> ".join(tiers) + tail


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE",
                   help="deployment YAML; its backends are the ones examined (KVTIER_... overrides apply)")
    add_engine_argument(p)
    p.add_argument("--backend", action="append", metavar="NAME",
                   help="only this backend (by its name in the config); repeatable")
    add_scope_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is shown on stderr only when stderr is a terminal)")


def add_scope_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--all-namespaces", action="store_true",
                   help="work on every namespace the backends hold, other deployments' included (default: "
                        "only the config's own: its namespace, its other ranks and KV cache groups)")


#: The manifest fields that say which deployment a namespace is: its model and layout, the same on every
#: TP / PP rank and KV cache group of one deployment (``tp_rank``, ``pp_rank``, ``kv_group`` are left out,
#: and so are the hash fields: a tool may not see the PYTHONHASHSEED the deployment resolved its seed with).
OWNER_FIELDS = {"id": "model", "kv_dtype": "kv_dtype", "num_layers": "num_layers", "num_kv_heads": "num_kv_heads",
                "head_dim": "head_dim", "block_size": "block_size", "attention": "attention",
                "tp_size": "tp_size", "pp_size": "pp_size"}


@dataclass(frozen=True)
class Scope:
    """Which namespaces a tool works on: every one (``all``), or the config's own: ``own_id`` (None for an
    engine YAML) and those whose manifest has each of ``fields`` (manifest name -> value)."""

    all: bool
    own_id: str | None
    fields: tuple[tuple[str, Any], ...]

    def owns(self, info: NamespaceInfo) -> bool:
        if self.all or info.id == self.own_id:
            return True
        m = info.manifest if info.namespace is not None else None
        return m is not None and all(m.get(k, _ABSENT) == v for k, v in self.fields)

    def ids(self, backend: StorageBackend, found: Iterable[str] = ()) -> tuple[list[str], int]:
        """(the namespace ids of ``backend`` this scope works on, how many others there are), from the
        backend's namespaces and ``found`` (ids a caller already listed); reads manifests, never blocks."""
        ids = set(found) | set(backend.namespaces())
        if self.all:
            return sorted(ids), 0
        mine = [ns for ns in sorted(ids) if self.owns(namespace_info(backend, ns))]
        return mine, len(ids) - len(mine)

    def others_line(self, n: int) -> str:
        """What a tool says of the namespaces it left out (their count only: not whose they are)."""
        return (f"{n} other namespace{'s' if n != 1 else ''} (other deployments') left out: "
                "--all-namespaces works on them too")


_ABSENT = object()


@dataclass
class Loaded:
    """A tool's config: ``filled`` lists the model fields an engine fills (None: a standalone config, whose
    namespace is its own); an engine YAML's model and namespace are placeholders."""

    cfg: KvtierConfig
    engine: str
    filled: list[str] | None

    @property
    def namespace_id(self) -> str | None:
        """The config's own namespace id; None for an engine YAML, which has none until the engine runs."""
        return None if self.filled is not None else self.cfg.namespace().id

    scope: Scope = Scope(True, None, ())

    def across_namespaces(self, config: str, doing: str) -> str:
        """The one line a tool prints for an engine YAML: which namespaces it works on."""
        head = (f"config {config}: model filled by the engine ({engine_label(self.engine)}) at start-up, so "
                f"the file names no namespace of its own: {doing} ")
        if self.scope.all:
            return head + "every namespace found in its backends"
        said = ", ".join(f"{k} = {v}" for k, v in self.scope.fields)
        return head + f"the namespaces whose manifest says {said}"


def scope_of(cfg: KvtierConfig, filled: list[str] | None, config: str, all_namespaces: bool) -> Scope:
    """The namespaces a tool given ``cfg`` works on (see the module's invariants); a UserError for an
    engine YAML that names no model, unless ``all_namespaces``."""
    if all_namespaces:
        return Scope(True, None, ())
    m = cfg.model
    if filled is None:
        return Scope(False, cfg.namespace().id, tuple((v, getattr(m, k)) for k, v in OWNER_FIELDS.items()))
    if "id" in filled:
        raise UserError(f"{config}: the file sets no model.id (the engine fills it at start-up), so which "
                        "namespaces are this deployment's cannot be told from other deployments': set model.id "
                        "to the model the engine serves, or pass --all-namespaces to work on every namespace")
    fields = tuple((v, getattr(m, k)) for k, v in OWNER_FIELDS.items() if k not in filled)
    # A tenant namespace's manifest names its tenant's tag: the engine's namespaces are that tenant's only.
    tenant = cfg.security.namespace_tenant
    return Scope(False, None, fields + ((("tenant", tenant),) if tenant else ()))


def load(args: argparse.Namespace, named: bool = False) -> Loaded:
    """The validated config, as ``args.engine`` loads it, or a UserError listing every problem (exit 2, no
    traceback).  ``named``: the tool was told which namespace to work on (its scope is then every one)."""
    try:
        cfg, filled = load_config_as_deployed(args.config, args.engine)
    except ConfigError as e:
        problems = [mask_secrets(p) for p in e.problems]
        if len(problems) == 1:
            msg = problems[0] if problems[0].startswith(f"{args.config}:") else \
                f"invalid config {args.config}: {problems[0]}"
        else:
            msg = f"invalid config {args.config} ({len(problems)} problems):" + "".join(f"\n  {p}" for p in problems)
        raise UserError(msg) from None
    if not cfg.backends:
        raise UserError(f"{args.config}: no backends configured (the `backends:` list is empty)")
    wanted = args.backend or []
    known = [b.name for b in cfg.backends]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise UserError(f"no backend named {', '.join(map(repr, unknown))} in {args.config}; "
                        f"it has {', '.join(map(repr, known))}")
    scope = scope_of(cfg, filled, args.config, named or bool(getattr(args, "all_namespaces", False)))
    return Loaded(cfg, args.engine, filled, scope)


@dataclass
class OpenedBackend:
    """One configured backend: the instance (None if it could not be opened, ``error`` says why) and
    its configured ``capacity`` option in bytes (None when it has none)."""

    conf: BackendConfig
    backend: StorageBackend | None
    capacity: int | None
    error: str | None = None
    location: str = ""

    @property
    def name(self) -> str:
        return str(self.conf.name)

    def header(self) -> dict[str, Any]:
        """The fields every tool's JSON reports for a backend."""
        return {"name": self.name, "type": self.conf.type, "location": self.location,
                "capacity_bytes": self.capacity, "error": self.error}


def describe_location(options: Any) -> str:
    """Where a backend keeps its blocks, from its options (never a secret)."""
    parts = []
    for key in ("path", "url", "endpoint_url", "bucket", "prefix"):
        value = getattr(options, key, None) if not isinstance(options, dict) else options.get(key)
        if isinstance(value, str) and value:
            parts.append(f"{key}={value}")
    return mask_secrets(", ".join(parts))


def open_backend(conf: BackendConfig, cfg: KvtierConfig, keys: bool = True) -> OpenedBackend:
    """Open one configured backend with its ``capacity`` lifted (see the module's invariants) and its
    security mode (``cfg.security``'s keys; ``keys=False``: without them, for a tool that only lists and
    counts); a failure (or a ``path`` naming nothing, which opening would create) is the entry's
    ``error``."""
    opts = conf.options
    capacity = getattr(opts, "capacity", None)
    capacity = capacity if isinstance(capacity, int) and not isinstance(capacity, bool) else None
    if capacity is not None and hasattr(opts, "model_copy"):
        opts = opts.model_copy(update={"capacity": UNBOUNDED})
    ob = OpenedBackend(conf, None, capacity, location=describe_location(opts))
    path = getattr(opts, "path", None)
    if isinstance(path, str) and path and not os.path.exists(path):
        # Opening would create it (local_disk does): a tool reports the typo instead.
        ob.error = f"{path} does not exist"
        return ob
    try:
        ob.backend = cfg.build_backend(conf, opts, keys=keys)
    except Exception as e:  # noqa: BLE001 - reported per backend; the others still run
        ob.error = f"cannot open: {mask_secrets(f'{type(e).__name__}: {e}')}"
    return ob


@contextlib.contextmanager
def open_backends(cfg: KvtierConfig, only: list[str] | None = None, *,
                  keys: bool = True) -> Iterator[list[OpenedBackend]]:
    """Open the config's backends (those named in ``only``, else all), closing them on exit (``keys``: as
    ``open_backend``)."""
    opened: list[OpenedBackend] = []
    try:
        for conf in cfg.backends:
            if not only or conf.name in only:
                opened.append(open_backend(conf, cfg, keys))
        yield opened
    finally:
        for ob in opened:
            if ob.backend is not None:
                with contextlib.suppress(Exception):
                    ob.backend.close()


def error_text(e: BaseException) -> str:
    return mask_secrets(str(e) or type(e).__name__)


@dataclass
class NamespaceInfo:
    """A namespace id and what its manifest says: ``namespace`` is None when there is no usable manifest
    (``problem`` says why)."""

    id: str
    manifest: dict[str, Any] | None = None
    namespace: Namespace | None = None
    problem: str | None = None

    @property
    def layout_id(self) -> int | None:
        return self.namespace.layout_id if self.namespace else None

    @property
    def payload_nbytes(self) -> int | None:
        """Payload bytes of one stored value of this namespace (``kvtier.format.layout``'s block_nbytes times the
        engine blocks per value), if known."""
        ns = self.namespace
        if ns is None or ns.kv_dtype not in _ITEMSIZE:
            return None
        components = 1 if ns.attention == "mla" else 2
        return (ns.num_layers * components * ns.block_size * ns.num_kv_heads * ns.head_dim
                * _ITEMSIZE[ns.kv_dtype] * ns.storage_blocks)


def namespace_info(backend: StorageBackend, ns_id: str) -> NamespaceInfo:
    """Read and check ``ns_id``'s manifest (raises BackendError only when the backend fails)."""
    m = backend.get_manifest(ns_id)
    if m is None:
        return NamespaceInfo(ns_id, problem="no manifest")
    try:
        ns = Namespace.from_manifest(m)
    except (TypeError, ValueError) as e:
        return NamespaceInfo(ns_id, m, problem=f"manifest is not valid: {e}")
    if ns.id != ns_id:
        return NamespaceInfo(ns_id, m, problem=f"manifest describes namespace {ns.id}, not {ns_id}")
    return NamespaceInfo(ns_id, m, ns)


def header_layout_id(header: bytes | bytearray | memoryview) -> int:
    """The layout id a stored header claims (checked later against the header checksum)."""
    return int(_LAYOUT_FIELD.unpack_from(header, _LAYOUT_OFFSET)[0])


assert _LAYOUT_OFFSET + _LAYOUT_FIELD.size <= HEADER_SIZE


def progress(args: argparse.Namespace, iterable: Iterable[object] | None = None, **kw: Any) -> Any:
    """A tqdm bar on stderr; hidden with ``--no-progress`` or ``--json``, and when stderr is not a terminal."""
    from tqdm import tqdm

    disable = True if (args.no_progress or args.json) else None
    return tqdm(iterable, file=sys.stderr, disable=disable, leave=False, dynamic_ncols=True, **kw)


def emit_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(mask_secrets(json.dumps(doc, indent=2, sort_keys=False, default=str)) + "\n")


def say(bar: Any, text: str) -> None:
    """Print a line to stdout without tearing a progress bar."""
    if bar is not None and not getattr(bar, "disable", True):
        bar.write(mask_secrets(text), file=sys.stdout)
    else:
        print(mask_secrets(text))
