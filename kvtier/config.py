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

import copy
import os
from collections.abc import Hashable, Mapping
from importlib import resources
from typing import Annotated, Any, ClassVar, Literal, cast, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from . import plugins
from .config_errors import describe, is_model, join_path, problems_of, suggest, unwrap
from .keys import CANONICAL_PAYLOAD, HEAD_MAJOR_KINDS, Namespace
from .units import ByteSize, format_size

DEFAULT_CONFIG = "local.yaml"
KvDtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8"]
KV_DTYPES: tuple[str, ...] = get_args(KvDtype)


class ConfigError(ValueError):
    """An invalid configuration.  ``str(e)`` is ``problems`` joined by newlines; each is ``path: problem``."""

    def __init__(self, problems: list[str], source: str = "<dict>"):
        # One line each, whatever a key or a plugin's message holds, so `path: problem` lines stay lines.
        self.problems = [" ".join(p.splitlines()) for p in problems]
        self.source = source
        super().__init__("\n".join(self.problems))


# --------------------------------------------------------------------------- small field types


def _mapping(v: Any) -> Any:
    if v is None:  # `options:` with every line commented out
        return {}
    if isinstance(v, (dict, BaseModel)):
        return v
    raise PydanticCustomError("kvtier", "expected a mapping of plugin options, got {got}", {"got": describe(v)})


def _seed(v: Any) -> Any:
    if v is None or isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise PydanticCustomError("kvtier", "expected a string, an integer or null, got {got}", {"got": describe(v)})


def _pinned(v: Any) -> Any:
    if v == "auto" or isinstance(v, bool):
        return v
    raise PydanticCustomError("kvtier", 'expected "auto", true or false, got {got}', {"got": describe(v)})


def _cpus(v: Any) -> Any:
    from .threads import check_cpus

    if isinstance(v, str):
        try:
            return check_cpus(v)
        except ValueError as e:
            raise PydanticCustomError("kvtier", "{why}", {"why": str(e)}) from None
    raise PydanticCustomError("kvtier", 'expected "all", "inherit" or a CPU list like "0,2-3", got {got}',
                              {"got": describe(v)})


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
    kv_dtype: KvDtype = Field("bfloat16", description="dtype of the KV cache tensors (int8: raw bytes, as a "
                                                        "hybrid model's state pages are stored).")
    num_layers: int = Field(ge=1, description="Attention layers whose KV is stored.")
    num_kv_heads: int = Field(ge=1, description="KV heads per layer on this rank (after TP split).")
    head_dim: int = Field(ge=1, description="Head dimension (MLA: the latent dimension).")
    block_size: int = Field(16, ge=1, description="Tokens per KV block; must equal the engine's.")
    attention: Literal["mha", "mla"] = Field("mha", description="mha: K and V per token; mla: one latent.")
    tp_rank: int = Field(0, ge=0, description="Tensor-parallel rank, 0 <= tp_rank < tp_size.")
    tp_size: int = Field(1, ge=1, description="Tensor-parallel size.")
    pp_rank: int = Field(0, ge=0, description="Pipeline-parallel rank, 0 <= pp_rank < pp_size.")
    pp_size: int = Field(1, ge=1, description="Pipeline-parallel size.")
    kv_group: str = Field("", description="Set by the vLLM connector for a hybrid model's KV cache group "
                                          "(empty for a model with one group).")


class KeysSection(_Section):
    """How block keys are computed (kvtier.keys)."""

    algo: Literal["sha256_cbor", "xxh3_128", "sglang_sha256"] = Field(
        "sha256_cbor", description="sha256_cbor: identical to vLLM's prefix-cache hash; xxh3_128: faster; "
                                   "sglang_sha256: SGLang's page keys (one store for vLLM and SGLang).")
    seed: Annotated[str | int | None, BeforeValidator(_seed)] = Field(
        None, description="Hash seed; null = PYTHONHASHSEED if set, else vLLM's default.")


class DeviceSection(_Section):
    """The engine's KV tensors (the fastest tier)."""

    kind: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available.")
    num_blocks: int = Field(1024, ge=1, description="Blocks in the standalone block pool (no engine).")
    layout: Literal["flash_attn", "flashinfer", "mla", "cpu_attn", "cpu_attn_amx", "stacked"] = Field(
        "flash_attn", description="How the engine lays out its KV tensors (cpu_attn / cpu_attn_amx: vLLM "
                                  "CPU's cache as its vec and amx kernels write it).")


class HostSection(_Section):
    """Host memory tier: one pre-allocated slab of block slots."""

    capacity: ByteSize = Field(1024**3, description='Slab size (default "1GiB"); "0" disables the host tier.')
    pinned: Annotated[Literal["auto"] | bool, BeforeValidator(_pinned)] = Field(
        "auto", description="Page-locked memory: auto = when CUDA is available.")
    prefault: bool = Field(True, description="Touch the whole slab at start-up (~0.2 s a GiB) so loads never "
                                             "pay first-touch page faults.")
    promote_loads: bool = Field(
        True, description="Blocks a load reads from a backend land in host memory too (true).  false: where "
                          "a backend reads a block straight into a CPU engine's KV tensors (local_disk, Redis; with a "
                          "layout whose blocks are their stored bytes), it does, and the block stays out of "
                          "host memory: a copy less per block, and the page cache holds it anyway.")


class BackendConfig(_Section):
    """One storage backend instance.  After validation with plugins, ``options`` is the plugin's validated
    ``Options`` model (a plain dict when the plugin has none, or plugins were not resolved)."""

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                             description="Instance name, unique in the list (default: the type).")
    type: str = Field(description="Plugin name in entry-point group kvtier.backends: local_disk, redis, s3, ...")
    options: PluginOptions = Field(default_factory=dict)
    write: bool = Field(True, description="false = read-only use (e.g. a decode instance that never stores).")
    quota: ByteSize | None = Field(
        None, description='Bytes each namespace this deployment writes may hold in this backend, e.g. "20GiB" '
                          "(null: no quota), and each cache_salt tenant within it (local_disk, redis, s3).  "
                          "Over it, the namespace's (or tenant's) own least "
                          "recently used blocks go, never another's: for a store several deployments or "
                          "tenants share (a local_disk directory, a Redis "
                          "key_prefix, an S3 prefix).  local_disk's capacity evictions also skip the blocks "
                          "of a namespace within its quota; in Redis and S3, give every sharing deployment "
                          "one, their sum within maxmemory / the bucket's budget.")
    security: Literal["none", "authenticate", "encrypt"] = Field(
        "none", description="none: values carry a checksum, which catches damage but not a writer's intent; "
                            "authenticate: each value carries an AES-GCM tag made with a key derived from "
                            "security.keys, and a value without a valid one is never served (counted as "
                            "forged, deleted); encrypt: the same, and the KV is stored encrypted "
                            "(AES-256-GCM).  Every instance sharing this store must use the same mode.")

    @model_validator(mode="after")
    def _default_name(self) -> BackendConfig:
        if self.name is None:
            self.name = self.type
        return self

    def plugin(self) -> Any:
        """The backend class (raises ``plugins.PluginError``)."""
        return plugins.load("backend", self.type)


class KeySource(_Section):
    """Where one deployment key is read from; the config never holds the key itself."""

    id: int = Field(ge=1, le=65535, description="The key's id, stored in every value it seals (so a reader "
                                                "picks the right key during a rotation).")
    file: str | None = Field(None, description="A file holding the key as hex or base64 text, at least 32 "
                                               "bytes (openssl rand -hex 32 > FILE); ~ and $VARS expand.")
    env: str | None = Field(None, description="Or: an environment variable holding it, likewise.")

    @model_validator(mode="after")
    def _one_source(self) -> KeySource:
        if (self.file is None) == (self.env is None):
            raise PydanticCustomError("kvtier", "expected exactly one of file or env (where the key is read "
                                                "from), got {got}",
                                      {"got": "both" if self.file is not None else "neither"})
        return self


class SecuritySection(_Section):
    """Keys for backends whose ``security`` is authenticate or encrypt (kvtier.security).  Rotation: add
    the new key everywhere (readers accept every listed key), then make it ``write_key``, then drop the
    old one once its values are gone."""

    keys: list[KeySource] = Field(default_factory=list, description="Deployment keys accepted for reads.")
    write_key: int | None = Field(None, description="The id of the key new values are sealed with (default: "
                                                    "the only key; required when there are several).")
    tenant: str | None = Field(None, description="The cache_salt of the one tenant this deployment serves: "
                                                 "its values are sealed with that tenant's key, and no "
                                                 "other tenant's deployment can make values it accepts.")
    tenant_keys: bool = Field(False, description="true: keys are this tenant's keys (derived from a deployment "
                                                 "key with kvtier.security.derive_tenant_key), so this "
                                                 "deployment cannot make another tenant's values.")
    tenant_namespace: bool = Field(False, description="true: this deployment's blocks get a namespace of their "
                                   "own (security.tenant's tag folded into the namespace digest), so "
                                   "backends[i].quota bounds this tenant's share of a shared store and the tools "
                                   "see only its blocks; works in every security mode. Turning it on starts the "
                                   "tenant's stored blocks afresh (those under the shared namespace are no longer "
                                   "looked up).")

    @property
    def namespace_tenant(self) -> str:
        """``Namespace.tenant`` of this deployment: the tag of ``tenant`` with ``tenant_namespace``, else ''."""
        from .keys import tenant_tag

        return tenant_tag(self.tenant) if self.tenant_namespace and self.tenant else ""

    @property
    def write_id(self) -> int | None:
        if self.write_key is not None:
            return self.write_key
        return self.keys[0].id if len(self.keys) == 1 else None

    def problems(self, sealed: list[tuple[int, str]]) -> list[str]:
        """What keeps this section from being used by the backends ``sealed`` ((index, mode) of those not in
        mode none).  The keys themselves are read only when a backend opens (``seal``), so a tool that
        only counts (``kvtier inspect``) needs no key."""
        out = []
        seen: dict[int, int] = {}
        for i, k in enumerate(self.keys):
            j = seen.setdefault(k.id, i)
            if j != i:
                out.append(f"security.keys[{i}].id: duplicate key id {k.id} (also security.keys[{j}])")
        if self.write_key is not None and self.write_key not in seen:
            out.append(f"security.write_key: {self.write_key} is not the id of any of security.keys "
                       f"(ids: {', '.join(map(str, seen)) or 'none'})")
        elif self.write_key is None and len(self.keys) > 1:
            out.append(f"security.write_key: required with several keys: the id ({', '.join(map(str, seen))}) "
                       "of the one that seals new values")
        if self.tenant_keys and self.tenant is None:
            out.append("security.tenant_keys: true needs security.tenant (the cache_salt the tenant keys are for)")
        if self.tenant_namespace and not self.tenant:
            out.append("security.tenant_namespace: true needs security.tenant (the cache_salt of the tenant whose "
                       "namespace it is)")
        for i, mode in sealed:
            if not self.keys:
                out.append(f"backends[{i}].security: {mode} needs a deployment key: add security.keys "
                           "(a file or environment variable holding one)")
        if sealed:
            try:
                import cryptography.hazmat.primitives.ciphers.aead  # noqa: F401
            except ImportError:
                out.append(f"backends[{sealed[0][0]}].security: {sealed[0][1]} needs the cryptography package "
                           "(pip install 'kvtier[security]')")
        return out

    def seal(self, mode: str) -> Any:
        """The ``kvtier.security.Seal`` for a backend in ``mode`` (None for none), keys read now; a key that
        cannot be read is a ConfigError naming its key path (``security.keys[0].file: ...``)."""
        if mode == "none":
            return None
        from .security import KeyRing, KeySourceError, Seal, read_key

        write_id = self.write_id
        if not self.keys or write_id is None:
            raise ConfigError([f"security: mode {mode} needs security.keys and security.write_key"])
        material: dict[int, bytes] = {}
        problems = []
        for i, k in enumerate(self.keys):
            try:
                material[k.id] = read_key(k.file, k.env)
            except KeySourceError as e:
                problems.append(f"security.keys[{i}].{'file' if k.file is not None else 'env'}: {e}")
        if problems:
            raise ConfigError(problems)
        return Seal(mode, KeyRing(material, write_id, self.tenant, self.tenant_keys))


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


class StorageSection(_Section):
    """How blocks are grouped into stored values in the backends."""

    block_tokens: int | None = Field(
        None, ge=1, description="Tokens per stored value: a multiple of model.block_size (null = one engine "
                                "block per value).  Larger values mean fewer requests per prefix (S3, Redis); "
                                "a prompt's last, partial group is not stored, and backend hits round down "
                                "to whole groups.")
    payload: Literal["canonical", "engine"] = Field(
        "canonical", description="canonical: values hold KV as (token, head, dim), which every engine and "
                                 "host reads; engine: a cpu_attn / cpu_attn_amx cache's blocks as vLLM CPU "
                                 "keeps them (plain copies, ~4x faster there; only instances with the same "
                                 "layout read them).  Other layouts' blocks are canonical either way.")


class PoliciesSection(_Section):
    write: WritePolicyConfig = Field(default_factory=WritePolicyConfig)
    prefetch: PrefetchPolicyConfig = Field(default_factory=PrefetchPolicyConfig)
    eviction: EvictionPolicyConfig = Field(default_factory=EvictionPolicyConfig)


class TransferSection(_Section):
    threads: int = Field(4, ge=1, description="Threads moving bytes between host and backends.")
    cpus: Annotated[str, BeforeValidator(_cpus)] = Field(
        "all", description='CPUs kvtier\'s threads run on: "all" (any this process may use, whatever core the '
                           'engine pinned its own thread to), "inherit" (the starting thread\'s), or a list '
                           'like "2-3".')


class MetricsSection(_Section):
    prometheus_port: int | None = Field(None, ge=1, le=65535, description="Serve /metrics here; null = off.")
    # /metrics has no authentication, so it answers only this host unless the operator opens it.
    bind_address: str = Field(
        "127.0.0.1", description='IP address /metrics listens on: "127.0.0.1" (default) answers only this '
                                 'host; "0.0.0.0" (or "::") every interface, which a Prometheus on another '
                                 'host or in Kubernetes scraping the pod needs.  The port has no '
                                 'authentication: open it only where the network is trusted.')

    @field_validator("bind_address")
    @classmethod
    def _ip_address(cls, v: str) -> str:
        import ipaddress

        try:
            return str(ipaddress.ip_address(v))
        except ValueError:
            raise PydanticCustomError("kvtier", 'expected an IP address like "127.0.0.1", "0.0.0.0" or "::", '
                                                "got {got}", {"got": describe(v)}) from None


class KvtierConfig(_Section):
    """A whole deployment.  Invariant after ``parse_config``/``load_config``: every plugin named exists and
    its options are validated; backend names are unique; tp_rank < tp_size and pp_rank < pp_size."""

    model_config = ConfigDict(title="kvtier configuration")

    model: ModelSection
    keys: KeysSection = Field(default_factory=KeysSection)
    device: DeviceSection = Field(default_factory=DeviceSection)
    host: HostSection = Field(default_factory=HostSection)
    backends: list[BackendConfig] = Field(default_factory=list, description="Lookup order: fastest first.")
    storage: StorageSection = Field(default_factory=StorageSection)
    policies: PoliciesSection = Field(default_factory=PoliciesSection)
    transfer: TransferSection = Field(default_factory=TransferSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    security: SecuritySection = Field(default_factory=SecuritySection)

    def build_backend(self, b: BackendConfig, options: Any = None, *, keys: bool = True) -> Any:
        """The backend ``b`` names, opened with its options (or ``options``) and its security mode: every
        place that opens a configured backend goes through here, so none of them forgets the mode.
        ``keys=False``: opened without its keys, in mode none (a tool that only lists and counts)."""
        seal = self.security.seal(b.security) if keys else None  # keys first: a bad key opens nothing
        backend = b.plugin()(b.options if options is None else options, name=b.name)
        backend.secure(seal)
        backend.limit(b.quota if b.write else None)
        return backend

    def build_backends(self) -> list[Any]:
        return [self.build_backend(b) for b in self.backends]

    def namespace(self) -> Namespace:
        m = self.model
        return Namespace(model=m.id, kv_dtype=m.kv_dtype, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                         head_dim=m.head_dim, block_size=m.block_size, attention=m.attention,
                         tp_rank=m.tp_rank, tp_size=m.tp_size, pp_rank=m.pp_rank, pp_size=m.pp_size,
                         hash_algo=self.keys.algo, hash_seed=self.keys.seed,
                         storage_blocks=self.storage_blocks, payload=self.payload_arrangement,
                         kv_group=m.kv_group, tenant=self.security.namespace_tenant)

    @property
    def payload_arrangement(self) -> str:
        """``Namespace.payload``: the device layout whose own arrangement values keep
        (``storage.payload: engine`` with a head-major layout), else canonical."""
        if self.storage.payload == "engine" and self.device.layout in HEAD_MAJOR_KINDS:
            return self.device.layout
        return CANONICAL_PAYLOAD

    @property
    def storage_blocks(self) -> int:
        """Engine blocks per stored value (1 unless ``storage.block_tokens`` groups them)."""
        t = self.storage.block_tokens
        return 1 if t is None else t // self.model.block_size

    @property
    def writes_backends(self) -> bool:
        """Whether some backend is written (not every one ``write: false``)."""
        return any(b.write for b in self.backends)

    def reading_only(self) -> KvtierConfig:
        """This deployment with every backend read-only (``write: false``): for a process that loads what
        another one writes (a TP rank whose blocks rank 0 writes)."""
        return self.model_copy(update={"backends": [b.model_copy(update={"write": False}) for b in self.backends]})

    def summary(self, device_blocks: int | None = None, *, engine: str | None = None) -> str:
        """One line: the tiers from fastest to slowest.  ``device_blocks``: the engine's block count, where
        an engine owns the device blocks (``device.num_blocks`` sizes only the standalone pool).
        ``engine``: say the device blocks are that engine's, without a kind or layout (vLLM's scheduler
        process knows neither: its workers detect them from the KV tensors)."""
        d = self.device
        n = d.num_blocks if device_blocks is None else device_blocks
        tiers = [f"device ({engine}'s KV cache, {n} blocks)" if engine else f"device ({d.kind}, {d.layout}, {n} blocks)"]
        host = self.host
        tiers.append(f"host {format_size(host.capacity)}" if host.capacity else "host off")
        for b in self.backends:
            tiers.append(f"{b.name} ({b.type}{'' if b.write else ', read-only'})")
        arranged = self.payload_arrangement
        tail = f"; values keep {arranged}'s own arrangement" if arranged != CANONICAL_PAYLOAD else ""
        return " -> ".join(tiers) + tail


def direct_loads(config: KvtierConfig, reads_segments: list[bool], payload_rows: bool) -> list[bool]:
    """Per backend, whether a load reads its blocks straight into the engine's KV tensors and leaves them
    out of host memory: ``host.promote_loads`` is false, the KV tensors hold each block as its payload's
    rows in CPU memory (``payload_rows``), and the backend reads segments (``reads_segments``).  The
    stack and ``kvtier simulate`` both decide with this."""
    return [r and payload_rows and not config.host.promote_loads for r in reads_segments]


def json_schema() -> dict[str, Any]:
    """JSON Schema of the YAML file (plugin options are free objects: each plugin validates its own)."""
    schema = KvtierConfig.model_json_schema()
    schema["description"] = __doc__.split("\n\n")[0] + " Environment overrides: KVTIER_HOST__CAPACITY=8GiB etc."
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# --------------------------------------------------------------------------- environment overrides

ENV_PREFIX = "KVTIER_"


def _env_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        return text  # not YAML (e.g. "a: b: c"): the literal text is what the user meant


def apply_env_overrides(data: dict[str, Any],
                        env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
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


def _set_path(data: dict[str, Any], segs: list[str], value: Any) -> tuple[str | None, str]:
    """Set ``value`` at ``segs`` inside ``data``, creating missing mappings; (problem or None, path)."""
    node: Any = data
    tp: Any = KvtierConfig
    parts: list[str] = []
    for i, seg in enumerate(segs):
        where = join_path(parts) or "the top level"
        last = i == len(segs) - 1
        tp = unwrap(tp)
        if not seg:
            return "empty name between '__' separators", ""
        if get_origin(tp) is list:
            if not seg.isdigit() or not isinstance(node, list) or int(seg) >= len(node):
                n = len(node) if isinstance(node, list) else 0
                return f"{where} has no entry {describe(seg)} (it has {n}; an override can change an entry, not add one)", ""
            key: Any = int(seg)
            parts.append(f"[{seg}]")
            tp = get_args(tp)[0]
        else:
            if is_model(tp):
                if seg not in tp.model_fields:
                    allowed = list(tp.model_fields)
                    return f"{where} has no key {describe(seg)}" + (suggest(seg, allowed) or
                                                            f"; allowed keys: {', '.join(allowed)}"), ""
                tp = tp.model_fields[seg].annotation
            elif tp is not Any:
                return f"{where} is a single value; it has no key {describe(seg)}", ""
            if not isinstance(node, dict):
                return f"{where} is {describe(node)}, not a mapping; cannot set {describe(seg)} in it", ""
            key = seg
            parts.append(seg)
        if last:
            node[key] = value
        else:
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = [] if get_origin(unwrap(tp)) is list else {}
            node = node[key]
    return None, join_path(parts)


# --------------------------------------------------------------------------- YAML, plugins, entry points


class _Loader(yaml.SafeLoader):
    """Safe YAML, but a key repeated in one mapping is an error (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # unhashable key: construct_mapping reports it
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {describe(key)} (first at line {first + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    mapping: dict[Hashable, Any] = loader.construct_mapping(node, deep=deep)
    return mapping


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

if getattr(yaml, "__with_libyaml__", False):
    class _FastLoader(yaml.CSafeLoader):
        """``_Loader`` on libyaml's parser: 0.3 against 4 ms for a deployment's YAML (measured on
        configs/vllm-redis.yaml), the same constructors (a repeated key is refused alike)."""

    _FastLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
    _FAST: type | None = _FastLoader
else:  # pragma: no cover - PyYAML built without libyaml
    _FAST = None


def read_yaml(text: str, source: str) -> Any:
    if _FAST is not None:
        try:
            return yaml.load(text, Loader=_FAST)  # noqa: S506 - a CSafeLoader subclass
        except Exception:  # noqa: BLE001, S110 - said below, as PyYAML's own parser words it
            # libyaml's messages are terser (a tab is "a character that cannot start any token", without
            # naming it) and it raises UnicodeEncodeError on a lone surrogate: a document it refuses is read
            # again by the pure-Python parser, whose error (or, where the two differ, whose result) stands.
            pass
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
        hint = "" if name in plugins.names(kind) else suggest(name, plugins.names(kind))
        problems.append(f"{path}.{key}: {e}{hint}")
        return None
    opts = {} if options is None else options
    schema = getattr(cls, "Options", None)
    if not isinstance(opts, dict) or schema is None:
        return opts  # not a mapping: the structural validation reports it
    try:
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return plugins.strict_options(schema).model_validate(opts)  # unknown keys: errors, always
        return schema(**opts)
    except ValidationError as e:
        problems.extend(f"{p}: {m}" for p, m in problems_of(e, schema, (f"{path}.options",)))
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
                           f"got {describe(data)}"], source)
    data, sources, problems = apply_env_overrides(data, env or {})
    cfg = None
    try:
        cfg = KvtierConfig.model_validate(data)
    except ValidationError as e:
        problems += [f"{p}: {m}" for p, m in problems_of(e, KvtierConfig)]
    backend_options: dict[int, Any] = {}  # backends[i] -> its plugin's validated options
    policy_options: dict[str, Any] = {}  # policies.<section> -> its plugin's validated options
    if resolve_plugins:
        backends = data.get("backends")
        for i, b in enumerate(backends if isinstance(backends, list) else ()):
            if isinstance(b, dict) and isinstance(b.get("type"), str):
                backend_options[i] = _resolve_plugin("backend", b["type"], b.get("options"), f"backends[{i}]",
                                                     "type", problems)
        pols = data.get("policies") or {}
        for sect, info in PoliciesSection.model_fields.items():
            model = cast("type[_PolicyConfig]", info.annotation)
            p = (pols.get(sect) if isinstance(pols, dict) else None) or {}
            name = p.get("name", model.model_fields["name"].default) if isinstance(p, dict) else None
            if isinstance(name, str):
                policy_options[sect] = _resolve_plugin(model.KIND, name, p.get("options"), f"policies.{sect}",
                                                       "name", problems)
    if cfg is not None:
        problems += _cross_checks(cfg) + _quota_checks(cfg, backend_options)
    if problems:
        raise ConfigError([_blame(line, sources) for line in problems], source)
    assert cfg is not None
    # The plugins' validated Options models replace the raw mappings.
    for i, opts in backend_options.items():
        cfg.backends[i].options = opts
    for sect, opts in policy_options.items():
        getattr(cfg.policies, sect).options = opts
    return cfg


def _cross_checks(cfg: KvtierConfig) -> list[str]:
    out = []
    m = cfg.model
    for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
        if getattr(m, rank) >= getattr(m, size):
            out.append(f"model.{rank}: expected 0 <= {rank} < {size} ({getattr(m, size)}), got {getattr(m, rank)}")
    bt = cfg.storage.block_tokens
    if bt is not None and bt % m.block_size:
        out.append(f"storage.block_tokens: expected a multiple of model.block_size ({m.block_size}), got {bt}")
    first: dict[str, int] = {}
    for i, b in enumerate(cfg.backends):
        j = first.setdefault(b.name or b.type, i)  # (validated: a name defaults to the type)
        if j != i:
            out.append(f"backends[{i}].name: duplicate backend name {describe(b.name)} (also backends[{j}]); "
                       "give each instance a unique name")
    out += cfg.security.problems([(i, b.security) for i, b in enumerate(cfg.backends) if b.security != "none"])
    return out


def _quota_checks(cfg: KvtierConfig, options: Mapping[int, Any]) -> list[str]:
    """``backends[i].quota`` against its backend (``options``: the plugins' validated options by index)."""
    out = []
    for i, b in enumerate(cfg.backends):
        if b.quota is None:
            continue
        capacity = getattr(options.get(i), "capacity", None)
        if b.quota < 1:
            out.append(f"backends[{i}].quota: expected a size of at least 1 byte (null: no quota), got {b.quota}")
        elif not b.write:
            out.append(f"backends[{i}].quota: backend {b.name} is read-only (write: false): it writes nothing "
                       "to bound; drop the quota or the write: false")
        elif isinstance(capacity, int) and not isinstance(capacity, bool) and b.quota > capacity:
            out.append(f"backends[{i}].quota: {format_size(b.quota)} is more than backend {b.name}'s capacity "
                       f"({format_size(capacity)}): a quota is a share of it")
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


def config_text(path: str | os.PathLike[str] | None) -> tuple[str, str]:
    """(source name, text) of a config file, or of the embedded default for None."""
    if path is None:
        source = f"kvtier.configs/{DEFAULT_CONFIG}"
        return source, resources.files("kvtier.configs").joinpath(DEFAULT_CONFIG).read_text(encoding="utf-8")
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            return source, f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError([f"{source}: cannot read the file: {why}"], source) from None


def load_config(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
                resolve_plugins: bool = True) -> KvtierConfig:
    """Read, override from ``env`` (default ``os.environ``; ``{}`` for none) and validate a config file.
    ``None`` reads the embedded default, ``configs/local.yaml``."""
    source, text = config_text(path)
    return parse_config(read_yaml(text, source), source=source,
                        env=os.environ if env is None else env, resolve_plugins=resolve_plugins)


def load_engine_config(path: str | os.PathLike[str] | None, facts: Mapping[str, Any], *, engine: str,
                       device: Mapping[str, Any] | None = None,
                       env: Mapping[str, str] | None = None) -> KvtierConfig:
    """A deployment's config inside an engine that already knows the model: ``facts`` (``model``
    fields the engine reports: dtype, layers, heads, head dim, block size, ranks) fill the ``model``
    section; a YAML value that disagrees with the engine is an error naming the key, both values and the
    engine.  ``model.id`` from the YAML wins over the engine's name (paths differ between hosts that
    share blocks); ``device`` fields (the layout the engine's tensors have) are set the same way.
    ``path`` None: the embedded default config's tiers and policies, with the engine's model."""
    source, text = config_text(path)
    data = read_yaml(text, source)
    if path is None and isinstance(data, dict):  # the embedded default's tiers, the engine's model
        data.pop("model", None)
        data.pop("device", None)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a mapping at the top level, got {describe(data)}"], source)
    problems = []
    for section, given in (("model", facts), ("device", device or {})):
        mine = data.get(section) or {}
        if not isinstance(mine, dict):
            raise ConfigError([f"{section}: expected a mapping, got {describe(mine)}"], source)
        for k, v in given.items():
            if k in mine and k != "id" and mine[k] != v:
                problems.append(f"{section}.{k}: the YAML says {describe(mine[k])} but {engine} runs "
                                f"{describe(v)}; remove the key (the engine fills it) or make it match")
        data[section] = {**given, **mine}
    if problems:
        raise ConfigError(problems, source)
    return parse_config(data, source=source, env=os.environ if env is None else env)


#: The engines that fill a deployment's ``model`` section themselves (``load_engine_config``'s callers).
ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}

# Stand-ins for the model fields an engine reports, used where no engine runs (``kvtier config check``,
# ``kvtier doctor``): neutral values, so they make no key the file sets fail (block size 1 divides any
# storage.block_tokens); the engine checks the file's keys against its own values at start-up.
_ENGINE_PLACEHOLDERS: dict[str, Any] = {"id": "<the engine's model>", "kv_dtype": "bfloat16", "num_layers": 1,
                                        "num_kv_heads": 1, "head_dim": 1, "block_size": 1, "attention": "mha",
                                        "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "kv_group": ""}


def load_config_as_deployed(path: str | os.PathLike[str] | None, engine: str = "auto", *,
                            env: Mapping[str, str] | None = None) -> tuple[KvtierConfig, list[str] | None]:
    """Validate a deployment YAML as the process that uses it will load it, without that process:
    ``engine`` "none" standalone (``load_config``: ``kvtier run``, ``pd``); "vllm" / "sglang" as that engine
    fills the ``model`` section (``load_engine_config``), every model field the file leaves out taking a
    placeholder; "auto" as an engine when the file's ``model`` section is absent or lacks a required field
    (a standalone process could not run it), else standalone.

    Returns the config and, for an engine's YAML, the model fields the engine fills (None: standalone).
    Such a config's model and namespace are placeholders, not what the engine will run: only its other
    sections and the model keys the file sets are meaningful.  ``path`` None: the embedded default, whose
    model and device the engine replaces (as ``load_engine_config`` does)."""
    if engine not in ("auto", "none", *ENGINES):
        raise ValueError(f"engine: expected auto, none, {', '.join(ENGINES)}; got {engine!r}")
    env = os.environ if env is None else env
    source, text = config_text(path)
    data = read_yaml(text, source)
    if engine == "auto":
        model = data.get("model") if isinstance(data, dict) else None
        required = [k for k, f in ModelSection.model_fields.items() if f.is_required()]
        complete = isinstance(model, dict) and all(k in model for k in required)
        wrong = model is not None and not isinstance(model, dict)  # `model: 5`: reported as such
        engine = "none" if path is None or complete or wrong or not isinstance(data, dict) else "auto"
    if engine == "none":
        return parse_config(data, source=source, env=env), None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a mapping at the top level, got {describe(data)}"], source)
    if path is None:  # the embedded default's tiers, the engine's model
        data.pop("model", None)
        data.pop("device", None)
    mine = data.get("model") or {}
    if not isinstance(mine, dict):
        raise ConfigError([f"model: expected a mapping, got {describe(mine)}"], source)
    fill = {k: v for k, v in _ENGINE_PLACEHOLDERS.items() if k not in mine}
    for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
        given = mine.get(rank)
        if size in fill and type(given) is int and given >= 0:  # a size that admits the rank the file sets
            fill[size] = given + 1
    data["model"] = {**fill, **mine}
    problems = []
    keys = data.get("keys")
    algo = keys.get("algo") if isinstance(keys, dict) else None
    if engine == "sglang" and algo is not None and algo != "sglang_sha256":  # as sglang.facts refuses it
        problems.append(f"keys.algo: the YAML says {describe(algo)} but SGLang names its pages itself "
                        "(sglang_sha256); remove the key, or set it to sglang_sha256 (also on a vLLM "
                        "instance that shares these blocks)")
    try:
        cfg = parse_config(data, source=source, env=env)
    except ConfigError as e:
        raise ConfigError(problems + e.problems, source) from None
    if problems:
        raise ConfigError(problems, source)
    if engine == "sglang":  # its keys are SGLang's page hashes, whatever the file leaves to the default
        cfg = cfg.model_copy(update={"keys": cfg.keys.model_copy(update={"algo": "sglang_sha256"})})
    return cfg, [k for k in ModelSection.model_fields if k in fill]
