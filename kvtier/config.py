"""YAML -> typed, validated kvtier configuration.

A config file describes one deployment: the model (which fixes the key namespace), the device and host
memory tiers, an ordered list of storage backends, and the policies.  ``kvtier config schema`` prints
the JSON Schema (every key, type, default and description); ``configs/*.yaml`` are commented examples.

Loading: ``load_config(path)`` reads a file (``None`` -> the embedded default ``configs/local.yaml``),
applies environment overrides, then validates everything, including each plugin's own ``options``
(the plugin class's ``Options`` pydantic model).  Any problem raises ``ConfigError``: one line per
problem, ``path: problem``, e.g. ``host.capacity: expected a size like "4GiB", got "lots"`` or
``host.capacty: unknown key; did you mean "capacity"?``.  No input produces a traceback.

Sizes (``host.capacity``, backends' ``capacity``): int bytes or ``"4GiB"``, ``"512MiB"``, ``"1.5GB"``,
``"100kB"``, ``"0"`` (``kvtier.units``).  Paths in backend options may use ``~`` and ``$VARS``; the backend
expands them when it opens, so a config file stays portable between users and hosts.

Environment overrides, applied to the YAML data before validation:

    KVTIER_<PATH>=<value>      e.g.  KVTIER_HOST__CAPACITY=8GiB
                                     KVTIER_BACKENDS__0__OPTIONS__PATH=/data/kv
                                     KVTIER_POLICIES__WRITE__NAME=write_back

``__`` separates levels, list entries are numbered from 0, names are case-insensitive (keys are
lowercase).  The value is parsed as YAML (``8`` is an int, ``true`` a bool, an empty value null,
``[a, b]`` a list); text that is not valid YAML is kept as a string.  A variable is an override when
its name contains ``__`` or is ``KVTIER_<SECTION>``; others (``KVTIER_CONFIG``, ...) are left alone.
An override naming a key that does not exist, or a list entry that does not exist, is an error naming
the variable; an override's bad value is reported with the variable's name.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from importlib import resources
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from . import plugins
from .keys import Namespace
from .units import ByteSize, format_size

DEFAULT_CONFIG = "local.yaml"
KV_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")


class ConfigError(ValueError):
    """An invalid configuration.  ``str(e)`` is ``problems`` joined by newlines; each is ``path: problem``."""

    def __init__(self, problems: list[str], source: str = "<dict>"):
        # One line each, whatever a key or a plugin's message holds, so `path: problem` lines stay lines.
        self.problems = [" ".join(p.splitlines()) for p in problems]
        self.source = source
        super().__init__("\n".join(self.problems))


# --------------------------------------------------------------------------- small field types


def _describe(v: Any) -> str:
    """A value as the user wrote it in YAML: strings in double quotes, null/true/false, short JSON.
    A URL's password is masked; containers are rendered only as far as the 60 characters shown (a
    YAML alias bomb expands to billions of items, and an alias can make a list contain itself)."""
    if isinstance(v, _Hidden):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(_URL_PASSWORD.sub(r"\1***@", v), ensure_ascii=False)
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return repr(v)
    text = _short_json(v, 61)
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = {dict: "a mapping", list: "a list", tuple: "a list"}.get(type(v), type(v).__name__)
    return f"{kind} {text}"


_URL_PASSWORD = re.compile(r"(://[^/@\s:]*:)[^/@\s]*@")


class _Hidden:
    def __repr__(self) -> str:
        return "(hidden: a secret)"


_HIDDEN = _Hidden()


class _Enough(Exception):
    pass


def _short_json(v: Any, limit: int) -> str:
    """``json.dumps(v, default=str)`` cut after ``limit`` characters, walking no further than that."""
    out: list[str] = []
    size = 0

    def emit(s: str) -> None:
        nonlocal size
        out.append(s)
        size += len(s)
        if size >= limit:
            raise _Enough

    def walk(x: Any, path: set[int]) -> None:
        if isinstance(x, (dict, list, tuple)):
            if id(x) in path:  # a container holding itself (YAML aliases allow it)
                emit("...")
                return
            path.add(id(x))
            emit("{" if isinstance(x, dict) else "[")
            for i, item in enumerate(x.items() if isinstance(x, dict) else x):
                if i:
                    emit(", ")
                if isinstance(x, dict):
                    emit(json.dumps(item[0] if isinstance(item[0], str) else str(item[0]),
                                    ensure_ascii=False) + ": ")
                    item = item[1]
                walk(item, path)
            emit("}" if isinstance(x, dict) else "]")
            path.discard(id(x))
        else:
            emit(_describe(x) if isinstance(x, str) or x is None or isinstance(x, (bool, int, float))
                 else json.dumps(str(x), ensure_ascii=False))

    with contextlib.suppress(_Enough):
        walk(v, set())
    return "".join(out)


def _mapping(v: Any) -> Any:
    if v is None:  # `options:` with every line commented out
        return {}
    if isinstance(v, (dict, BaseModel)):
        return v
    raise PydanticCustomError("kvtier", "expected a mapping of plugin options, got {got}", {"got": _describe(v)})


def _seed(v: Any) -> Any:
    if v is None or isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise PydanticCustomError("kvtier", "expected a string, an integer or null, got {got}", {"got": _describe(v)})


def _pinned(v: Any) -> Any:
    if v == "auto" or isinstance(v, bool):
        return v
    raise PydanticCustomError("kvtier", 'expected "auto", true or false, got {got}', {"got": _describe(v)})


PluginOptions = Annotated[Any, BeforeValidator(_mapping), WithJsonSchema({
    "type": "object",
    "description": "The plugin's own options, validated by its `Options` model (see the plugin's docs). "
                   "Paths may use ~ and $VARS; the plugin expands them.",
})]


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, types are strict (YAML "4" is not the int 4),
    and an empty section (``host:`` with nothing under it) means all defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_is_default(cls, v: Any) -> Any:
        return {} if v is None else v


# --------------------------------------------------------------------------- the schema


class ModelSection(_Section):
    """What makes block bytes interchangeable.  Every field goes into the key namespace digest, so two
    deployments that differ in any of them never read each other's blocks."""

    id: str = Field(min_length=1, description="Model id, e.g. a Hugging Face repo id.")
    kv_dtype: Literal[KV_DTYPES] = Field("bfloat16", description="dtype of the KV cache tensors.")
    num_layers: int = Field(ge=1, description="Attention layers whose KV is stored.")
    num_kv_heads: int = Field(ge=1, description="KV heads per layer on this rank (after TP split).")
    head_dim: int = Field(ge=1, description="Head dimension (MLA: the latent dimension).")
    block_size: int = Field(16, ge=1, description="Tokens per KV block; must equal the engine's.")
    attention: Literal["mha", "mla"] = Field("mha", description="mha: K and V per token; mla: one latent.")
    tp_rank: int = Field(0, ge=0, description="Tensor-parallel rank, 0 <= tp_rank < tp_size.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size.")
    pp_rank: int = Field(0, ge=0, description="Pipeline-parallel rank, 0 <= pp_rank < pp_size.")
    pp_size: int = Field(1, ge=1, description="Pipeline-parallel size.")


class KeysSection(_Section):
    """How block keys are computed (kvtier.keys)."""

    algo: Literal["sha256_cbor", "xxh3_128"] = Field(
        "sha256_cbor", description="sha256_cbor: identical to vLLM's prefix-cache hash; xxh3_128: faster.")
    seed: Annotated[str | int | None, BeforeValidator(_seed)] = Field(
        None, description="Hash seed; null = PYTHONHASHSEED if set, else vLLM's default.")


class DeviceSection(_Section):
    """The engine's KV tensors (the fastest tier)."""

    kind: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available.")
    num_blocks: int = Field(1024, ge=1, description="Blocks in the standalone block pool (no engine).")
    layout: Literal["flash_attn", "flashinfer", "mla", "stacked"] = Field(
        "flash_attn", description="How the engine lays out its KV tensors.")


class HostSection(_Section):
    """Host memory tier: one pre-allocated slab of block slots."""

    capacity: ByteSize = Field(1024**3, description='Slab size (default "1GiB"); "0" disables the host tier.')
    pinned: Annotated[Literal["auto"] | bool, BeforeValidator(_pinned)] = Field(
        "auto", description="Page-locked memory: auto = when CUDA is available.")


class BackendConfig(_Section):
    """One storage backend instance.  After validation with plugins, ``options`` is the plugin's validated
    ``Options`` model (a plain dict when the plugin has none, or plugins were not resolved)."""

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                             description="Instance name, unique in the list (default: the type).")
    type: str = Field(description="Plugin name in entry-point group kvtier.backends: local_disk, redis, s3, ...")
    options: PluginOptions = Field(default_factory=dict)
    write: bool = Field(True, description="false = read-only use (e.g. a decode instance that never stores).")

    @model_validator(mode="after")
    def _default_name(self) -> BackendConfig:
        if self.name is None:
            self.name = self.type
        return self

    def plugin(self) -> Any:
        """The backend class (raises ``plugins.PluginError``)."""
        return plugins.load("backend", self.type)


class _PolicyConfig(_Section):
    KIND: ClassVar[str]
    name: str
    options: PluginOptions = Field(default_factory=dict)

    def plugin(self) -> Any:
        """The policy class (raises ``plugins.PluginError``)."""
        return plugins.load(self.KIND, self.name)


class WritePolicyConfig(_PolicyConfig):
    """When blocks are copied down a tier (entry-point group kvtier.write_policies)."""

    KIND: ClassVar[str] = "write_policy"
    name: str = Field("write_through", description="write_through | write_through_selective | write_back | ...")


class PrefetchPolicyConfig(_PolicyConfig):
    """How long a request waits for blocks loading from backends (group kvtier.prefetch_policies)."""

    KIND: ClassVar[str] = "prefetch_policy"
    name: str = Field("best_effort", description="best_effort | wait_complete | timeout | ...")
    threshold_tokens: int = Field(256, ge=0, description="Prefetch only when the storage hit is >= this.")


class EvictionPolicyConfig(_PolicyConfig):
    """Which block leaves a full tier first (group kvtier.eviction_policies)."""

    KIND: ClassVar[str] = "eviction_policy"
    name: str = Field("lru", description="lru | ...")


class PoliciesSection(_Section):
    write: WritePolicyConfig = Field(default_factory=WritePolicyConfig)
    prefetch: PrefetchPolicyConfig = Field(default_factory=PrefetchPolicyConfig)
    eviction: EvictionPolicyConfig = Field(default_factory=EvictionPolicyConfig)


class TransferSection(_Section):
    threads: int = Field(4, ge=1, description="Threads moving bytes between host and backends.")


class MetricsSection(_Section):
    prometheus_port: int | None = Field(None, ge=1, le=65535, description="Serve /metrics here; null = off.")


class KvtierConfig(_Section):
    """A whole deployment.  Invariant after ``parse_config``/``load_config``: every plugin named exists and
    its options are validated; backend names are unique; tp_rank < tp_size and pp_rank < pp_size."""

    model_config = ConfigDict(title="kvtier configuration")

    model: ModelSection
    keys: KeysSection = Field(default_factory=KeysSection)
    device: DeviceSection = Field(default_factory=DeviceSection)
    host: HostSection = Field(default_factory=HostSection)
    backends: list[BackendConfig] = Field(default_factory=list, description="Lookup order: fastest first.")
    policies: PoliciesSection = Field(default_factory=PoliciesSection)
    transfer: TransferSection = Field(default_factory=TransferSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)

    def namespace(self) -> Namespace:
        m = self.model
        return Namespace(model=m.id, kv_dtype=m.kv_dtype, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                         head_dim=m.head_dim, block_size=m.block_size, attention=m.attention,
                         tp_rank=m.tp_rank, tp_size=m.tp_size, pp_rank=m.pp_rank, pp_size=m.pp_size,
                         hash_algo=self.keys.algo, hash_seed=self.keys.seed)

    def summary(self) -> str:
        """One line: the tiers from fastest to slowest."""
        d = self.device
        tiers = [f"device ({d.kind}, {d.layout}, {d.num_blocks} blocks)"]
        host = self.host
        tiers.append(f"host {format_size(host.capacity)}" if host.capacity else "host off")
        for b in self.backends:
            tiers.append(f"{b.name} ({b.type}{'' if b.write else ', read-only'})")
        return " -> ".join(tiers)


def json_schema() -> dict[str, Any]:
    """JSON Schema of the YAML file (plugin options are free objects: each plugin validates its own)."""
    schema = KvtierConfig.model_json_schema()
    schema["description"] = __doc__.split("\n\n")[0] + " Environment overrides: KVTIER_HOST__CAPACITY=8GiB etc."
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# --------------------------------------------------------------------------- pydantic errors -> lines


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``X | None`` so the walk below sees the structural type."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
        elif get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp):
            rest = [a for a in get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp
            tp = rest[0]
        else:
            return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _walk(root: type[BaseModel], loc: tuple) -> tuple[list[str], type[BaseModel] | None, Any, Any]:
    """Follow a pydantic error location through the model classes.

    Returns (path parts, model owning the last key, its FieldInfo or None, the annotation there).
    Elements left once a scalar is reached are union-member tags ("int", "str", ...), not keys: dropped.
    """
    parts: list[str] = []
    tp: Any = root
    owner, field = None, None
    for el in loc:
        tp = _unwrap(tp)
        if _is_model(tp):
            owner = tp
            field = next((f for n, f in tp.model_fields.items() if el in (n, f.alias)), None)
            parts.append(str(el))
            if field is None:
                return parts, owner, None, None
            tp = field.annotation
        elif get_origin(tp) in (list, tuple) and isinstance(el, int):
            parts.append(f"[{el}]")
            tp = get_args(tp)[0]
        elif get_origin(tp) in (dict, Mapping):
            parts.append(str(el))
            tp = get_args(tp)[1]
        else:
            break
    return parts, owner, field, _unwrap(tp)


def _join(parts: list[str] | tuple[str, ...]) -> str:
    return "".join(p if p.startswith("[") or i == 0 else "." + p for i, p in enumerate(parts))


def _bounds(field: Any) -> str:
    lo = hi = None
    for m in getattr(field, "metadata", ()):
        lo = getattr(m, "ge", lo)
        hi = getattr(m, "le", hi)
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    return f" >= {lo}" if lo is not None else (f" <= {hi}" if hi is not None else "")


def _suggest(word: Any, allowed: list[str]) -> str:
    """A did-you-mean hint.  Only names with the same first letter: typos rarely hit it, and "gpu" must
    not be answered with "cpu"."""
    same = [a for a in allowed if isinstance(word, str) and a[:1].lower() == word[:1].lower()]
    close = difflib.get_close_matches(word, same, n=1) if same else []
    return f'; did you mean "{close[0]}"?' if close else ""


_EXPECT = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number", "bool_type": "true or false",
    "bool_parsing": "true or false", "string_type": "a string", "dict_type": "a mapping",
    "model_type": "a mapping", "model_attributes_type": "a mapping", "list_type": "a list",
    "tuple_type": "a list", "none_required": "null", "url_type": "a URL", "url_parsing": "a URL",
}


def _message(err: dict, owner: type[BaseModel] | None, field: Any, tp: Any) -> str:
    kind, got, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "missing":
        return "missing required " + ("section" if _is_model(tp) else "key")
    if kind == "extra_forbidden":
        allowed = list(owner.model_fields) if owner else []
        key = err["loc"][-1]
        return "unknown key" + (_suggest(key, allowed) or f"; allowed keys: {', '.join(allowed)}")
    if kind in ("size", "kvtier"):
        return err["msg"]
    if kind == "invalid_key":
        return f"keys must be strings, got {_describe(got)}"
    if kind == "literal_error":
        values = [str(v) for v in get_args(tp)] if get_origin(tp) is Literal else []
        allowed = ", ".join(json.dumps(v) for v in values) or ctx.get("expected", "?")
        return f"expected one of {allowed}, got {_describe(got)}{_suggest(got, values)}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        noun = "an integer" if isinstance(got, int) else "a number"
        return f"expected {noun}{_bounds(field) or ' ' + err['msg'].split('Input should be ')[-1]}, got {got!r}"
    if kind == "string_too_short":
        n = ctx.get("min_length", 1)
        return f"expected a {'non-empty string' if n == 1 else f'string of at least {n} characters'}, got {_describe(got)}"
    if kind == "string_pattern_mismatch":
        return f"expected a name matching {ctx.get('pattern')}, got {_describe(got)}"
    if kind in _EXPECT:
        bounds = _bounds(field) if kind.startswith(("int", "float")) else ""
        return f"expected {_EXPECT[kind]}{bounds}, got {_describe(got)}"
    text = str(ctx["error"]) if "error" in ctx else err["msg"].removeprefix("Value error, ")
    return text if "got" in text or isinstance(got, (dict, BaseModel)) else f"{text}, got {_describe(got)}"


def _problems(exc: ValidationError, root: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(path, problem) per error; errors from the members of one union at one path are merged."""
    out: dict[str, list[str]] = {}
    for err in exc.errors(include_url=False):
        parts, owner, field, tp = _walk(root, err["loc"])
        path = _join([*prefix, *parts]) or "(top level)"
        if tp is SecretStr and "input" in err:  # a password typed as a number is still a password
            err = {**err, "input": _HIDDEN}
        out.setdefault(path, []).append(_URL_PASSWORD.sub(r"\1***@", _message(err, owner, field, tp)))
    merged = []
    for path, msgs in out.items():
        if len(msgs) > 1 and all(m.startswith("expected ") for m in msgs):
            got = msgs[0].rsplit(", got ", 1)[-1]
            msgs = ["expected " + " or ".join(m[9:].rsplit(", got ", 1)[0] for m in msgs) + ", got " + got]
        merged.extend((path, m) for m in dict.fromkeys(msgs))
    return merged


# --------------------------------------------------------------------------- environment overrides

ENV_PREFIX = "KVTIER_"


def _env_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        return text  # not YAML (e.g. "a: b: c"): the literal text is what the user meant


def apply_env_overrides(data: dict, env: Mapping[str, str]) -> tuple[dict, dict[str, str], list[str]]:
    """``data`` (not modified) with every ``KVTIER_...`` override applied.

    Returns (new data, {dotted path: variable name}, problems).  Keys are checked against the schema,
    except below a plugin's ``options`` (the plugin's own validation reports those, with the variable).
    """
    data = copy.deepcopy(data)
    sources: dict[str, str] = {}
    problems: list[str] = []
    top = set(KvtierConfig.model_fields)
    for var in sorted(env):
        rest = var[len(ENV_PREFIX):] if var.startswith(ENV_PREFIX) else None
        if rest is None or ("__" not in rest and rest.lower() not in top):
            continue
        segs = rest.lower().split("__")
        problem, path = _set_path(data, segs, _env_value(env[var]))
        if problem:
            problems.append(f"{var}: {problem}")
        else:
            sources[path] = var
    return data, sources, problems


def _set_path(data: dict, segs: list[str], value: Any) -> tuple[str | None, str]:
    """Set ``value`` at ``segs`` inside ``data``, creating missing mappings; (problem or None, path)."""
    node: Any = data
    tp: Any = KvtierConfig
    parts: list[str] = []
    for i, seg in enumerate(segs):
        where = _join(parts) or "the top level"
        last = i == len(segs) - 1
        tp = _unwrap(tp)
        if not seg:
            return "empty name between '__' separators", ""
        if get_origin(tp) is list:
            if not seg.isdigit() or not isinstance(node, list) or int(seg) >= len(node):
                n = len(node) if isinstance(node, list) else 0
                return f"{where} has no entry {_describe(seg)} (it has {n}; an override can change an entry, not add one)", ""
            key: Any = int(seg)
            parts.append(f"[{seg}]")
            tp = get_args(tp)[0]
        else:
            if _is_model(tp):
                if seg not in tp.model_fields:
                    allowed = list(tp.model_fields)
                    return f"{where} has no key {_describe(seg)}" + (_suggest(seg, allowed) or
                                                            f"; allowed keys: {', '.join(allowed)}"), ""
                tp = tp.model_fields[seg].annotation
            elif tp is not Any:
                return f"{where} is a single value; it has no key {_describe(seg)}", ""
            if not isinstance(node, dict):
                return f"{where} is {_describe(node)}, not a mapping; cannot set {_describe(seg)} in it", ""
            key = seg
            parts.append(seg)
        if last:
            node[key] = value
        else:
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = [] if get_origin(_unwrap(tp)) is list else {}
            node = node[key]
    return None, _join(parts)


# --------------------------------------------------------------------------- YAML, plugins, entry points


class _Loader(yaml.SafeLoader):
    """Safe YAML, but a key repeated in one mapping is an error (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # unhashable key: construct_mapping reports it
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {_describe(key)} (first at line {first + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        ctx = f" ({e.context} at line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
        raise ConfigError([f"{where}: invalid YAML: {e.problem}{ctx}"], source) from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow: say where, on one line
        line = text.count("\n", 0, e.position) + 1
        col = e.position - text.rfind("\n", 0, e.position)
        raise ConfigError([f"{source}:{line}:{col}: invalid YAML: unacceptable character "
                           f"#x{e.character:04x}: {e.reason}"], source) from None
    except (yaml.YAMLError, RecursionError) as e:
        raise ConfigError([f"{source}: invalid YAML: {e}"], source) from None


def _resolve_plugin(kind: str, name: str, options: Any, path: str, key: str, problems: list[str]) -> Any:
    """The plugin's validated options (problems appended on failure; returns None then)."""
    try:
        cls = plugins.load(kind, name)
    except Exception as e:  # noqa: BLE001 - PluginError, or a broken registry: either way a config problem
        hint = "" if name in plugins.names(kind) else _suggest(name, plugins.names(kind))
        problems.append(f"{path}.{key}: {e}{hint}")
        return None
    opts = {} if options is None else options
    schema = getattr(cls, "Options", None)
    if not isinstance(opts, dict) or schema is None:
        return opts  # not a mapping: the structural validation reports it
    try:
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return schema.model_validate(opts)
        return schema(**opts)
    except ValidationError as e:
        problems.extend(f"{p}: {m}" for p, m in _problems(e, schema, (f"{path}.options",)))
    except Exception as e:  # noqa: BLE001 - a plugin's validator may raise anything; never a traceback
        problems.append(f"{path}.options: {type(e).__name__}: {e}")
    return None


def parse_config(data: Any, *, source: str = "<dict>", env: Mapping[str, str] | None = None,
                 resolve_plugins: bool = True) -> KvtierConfig:
    """Validate already-loaded data (``env``: overrides to apply, none by default).  ``resolve_plugins=False``
    checks only the structure (plugin names and options unchecked, options stay dicts)."""
    if data is None:
        raise ConfigError([f'{source}: the file is empty; expected a mapping with at least a "model:" section'],
                          source)
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a mapping at the top level (model:, host:, backends:, ...), "
                           f"got {_describe(data)}"], source)
    data, sources, problems = apply_env_overrides(data, env or {})
    cfg = None
    try:
        cfg = KvtierConfig.model_validate(data)
    except ValidationError as e:
        problems += [f"{p}: {m}" for p, m in _problems(e, KvtierConfig)]
    resolved: dict[tuple[str, int | str], Any] = {}
    if resolve_plugins:
        backends = data.get("backends")
        for i, b in enumerate(backends if isinstance(backends, list) else ()):
            if isinstance(b, dict) and isinstance(b.get("type"), str):
                resolved["b", i] = _resolve_plugin("backend", b["type"], b.get("options"), f"backends[{i}]",
                                                   "type", problems)
        pols = data.get("policies") or {}
        for sect, model in PoliciesSection.model_fields.items():
            p = (pols.get(sect) if isinstance(pols, dict) else None) or {}
            name = p.get("name", model.annotation.model_fields["name"].default) if isinstance(p, dict) else None
            if isinstance(name, str):
                resolved["p", sect] = _resolve_plugin(model.annotation.KIND, name, p.get("options"),
                                                      f"policies.{sect}", "name", problems)
    if cfg is not None:
        problems += _cross_checks(cfg)
    if problems:
        raise ConfigError([_blame(line, sources) for line in problems], source)
    assert cfg is not None
    for (what, at), opts in resolved.items():
        target = cfg.backends[at] if what == "b" else getattr(cfg.policies, at)
        target.options = opts  # the plugin's validated Options model replaces the raw mapping
    return cfg


def _cross_checks(cfg: KvtierConfig) -> list[str]:
    out = []
    m = cfg.model
    for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
        if getattr(m, rank) >= getattr(m, size):
            out.append(f"model.{rank}: expected 0 <= {rank} < {size} ({getattr(m, size)}), got {getattr(m, rank)}")
    first: dict[str, int] = {}
    for i, b in enumerate(cfg.backends):
        j = first.setdefault(b.name, i)
        if j != i:
            out.append(f"backends[{i}].name: duplicate backend name {_describe(b.name)} (also backends[{j}]); "
                       "give each instance a unique name")
    return out


def _blame(line: str, sources: dict[str, str]) -> str:
    """Name the environment variable behind a problem, since the file does not show that value."""
    path = line.split(": ", 1)[0]
    for p, var in sources.items():
        if path == p or path.startswith((p + ".", p + "[")):
            return f"{line} (set by environment variable {var})"
    for p, var in sources.items():  # a check of a whole section (e.g. a plugin's options) saw the override
        if p.startswith((path + ".", path + "[")):
            return f"{line} (environment variable {var} sets {p})"
    return line


def load_config(path: str | os.PathLike | None = None, *, env: Mapping[str, str] | None = None,
                resolve_plugins: bool = True) -> KvtierConfig:
    """Read, override from ``env`` (default ``os.environ``; ``{}`` for none) and validate a config file.
    ``None`` reads the embedded default, ``configs/local.yaml``."""
    if path is None:
        source = f"kvtier.configs/{DEFAULT_CONFIG}"
        text = resources.files("kvtier.configs").joinpath(DEFAULT_CONFIG).read_text(encoding="utf-8")
    else:
        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ConfigError([f"{source}: cannot read the file: {why}"], source) from None
    return parse_config(_read_yaml(text, source), source=source,
                        env=os.environ if env is None else env, resolve_plugins=resolve_plugins)
