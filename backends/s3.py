"""S3 backend: one object per block (header + payload), for AWS S3 and S3-compatible stores.

Invariants:
* One object per block, ``<prefix>/<namespace id>/<block hash hex>``; a PUT replaces it atomically, so a
  reader sees the old block or the new one, never a mix.  A missing object is a miss (None), never an error.
* Puts stream the caller's header and payload memoryviews to the socket (no joined copy; a payload in
  segments, ``writes_segments``, is streamed from its parts in order: botocore takes a file-like body, so
  one body never needs one buffer); gets read the
  response body straight into the caller's header and payload buffers (no intermediate bytes object).
* Every hook returns within ``call_budget_s = (retries + 1) * timeout_s + backoff`` (backoff is botocore's
  jittered exponential, at most ``sum(min(2**i, 20) for i < retries)`` s): each request has connect/read
  timeouts of ``timeout_s`` and botocore's retries, and the batch wait itself is cut at the budget.  A read
  abandoned at the budget is stopped before the hook returns (its socket is shut down), so no byte reaches a
  caller's buffer after the call.  An abandoned put may still finish later; it then stores either the whole
  block or bytes whose checksum fails on read (a miss), never a wrong block.
* Quotas per ``cache_salt`` tenant (``kvtier.quota``): a listing carries no object metadata, so a writer
  with a quota records each tenant block, after its own PUT succeeded, as a zero-byte marker object
  ``<prefix>tenants/<namespace id>/<tenant tag>/<block hash hex>`` (through the same pool, timeouts and
  call budget as the puts).  A key, a value and the namespace are the same with or without a tenant.  A
  count lists the share's markers (all of the namespace's tenants' for its untenanted share), *then* the
  namespace's blocks: a marker is written after its block, so one whose block that later listing lacks
  is stale (the block was deleted) and is dropped, never one of a block not yet listed.  A tenant's share
  is the listed blocks with a marker of its own, the untenanted share those with none; both oldest written
  first (the block's LastModified).  A quota's trim of a tenant deletes its markers with its blocks, in
  the same DeleteObjects request; other deletes (``kvtier gc``, a corrupt block) leave the marker to the
  next count.  Markers are no blocks: every listing of blocks (``_scan``: ``scan``, ``namespaces``,
  usage, the tools; ``_namespace_blocks``) stops where ``tenants/`` begins (namespace ids are hex, so
  they all sort before it).  A marker lost (its PUT failed: logged and counted, the put stands) makes its
  block count as the namespace's until it is written again with its tenant.
* Credentials come from boto3's standard chain unless given as options (``SecretStr``); they never appear
  in ``repr``, exception messages or log records (botocore's DEBUG output is scrubbed of them).  Each
  backend has its own session (credentials, configuration); only botocore's read-only data loader (the
  parsed service models and endpoint rules) is shared by the backends of a process.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import wait
from typing import Any, Literal

from pydantic import ConfigDict, Field, SecretStr

from kvtier import threads as kvthreads
from kvtier.backend_api import BackendOptions, StorageBackend, StoredBlock
from kvtier.format.blockformat import Segments
from kvtier.keys import invalid_key, key_problem
from kvtier.quota import Share

log = logging.getLogger("kvtier.backends.s3")
_MISSING = {"404", "NoSuchKey", "NotFound"}
# S3 error codes that say the service is there but busy or broken (retry later) / refuses these credentials.
_UNAVAILABLE = {"500", "502", "503", "InternalError", "ServiceUnavailable", "SlowDown", "Throttling"}
_DENIED = {"403", "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
           "ExpiredToken", "InvalidToken", "AccountProblem"}
_READ_CHUNK = 1 << 20  # bytes per socket read: the granularity at which an abandoned read can be stopped
_DELETE_BATCH = 1000  # the DeleteObjects limit
_MARKERS = "tenants/"  # under the prefix: the tenants' marker objects (sorts after every namespace id, hex)


class S3Options(BackendOptions):
    """YAML ``options:`` of the ``s3`` backend."""

    # A misspelt secret key must not be echoed back in the "extra inputs are not permitted" error.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)
    bucket: str = Field(min_length=3)
    prefix: str = ""  # key prefix; normalised to end in exactly one "/" (or empty)
    endpoint_url: str | None = None  # MinIO, Ceph, moto; None: AWS
    region: str | None = None  # None: the standard chain, else us-east-1
    max_workers: int = Field(8, ge=1, le=256)  # concurrent requests per batch (and pooled connections)
    retries: int = Field(2, ge=0, le=10)  # retries after the first attempt (botocore "standard" mode)
    create_bucket: bool = False
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    # The block carries its own xxh3 checksum, verified on every read; the transport CRCs botocore adds by
    # default cost another pass over each byte and some S3-compatible stores reject them.
    transport_checksums: bool = False
    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    usage_ttl_s: float = Field(30.0, ge=0)  # how long a usage listing is reused by stats()
    usage_max_objects: int = Field(100_000, ge=0)  # listing cap for usage; beyond it usage is partial


_LOADERS_LOCK = threading.Lock()
_LOADERS: dict[str | None, Any] = {}


def _data_loader(data_path: str | None) -> Any:
    """The process's botocore data loader for ``data_path`` (botocore's ``AWS_DATA_PATH``: service
    models and endpoint rules, files read only), shared by every S3 backend's session; credentials and
    configuration stay per session."""
    with _LOADERS_LOCK:
        if data_path not in _LOADERS:
            from botocore.loaders import create_loader

            _LOADERS[data_path] = create_loader(data_path)
        return _LOADERS[data_path]


class _Cancelled(Exception):
    pass


class _ReadGuard:
    """Lets a batch stop its in-flight body reads before returning: readers register how to shut down
    the socket they read from; ``cancel`` refuses new reads, shuts those down and waits for readers to
    leave (each socket read is bounded by the read timeout anyway, so the wait is too)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[int, Callable[[], None] | None] = {}
        self.cancelled = False

    @contextlib.contextmanager
    def reading(self, shutdown: Callable[[], None] | None) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self.cancelled:
                raise _Cancelled
            self._active[me] = shutdown
        try:
            yield
        finally:
            with self._cond:
                self._active.pop(me, None)
                self._cond.notify_all()

    def cancel(self, timeout_s: float) -> None:
        with self._cond:
            self.cancelled = True
            shutdowns = list(self._active.values())
        for shutdown in shutdowns:
            if shutdown is not None:
                with contextlib.suppress(Exception):  # already closed or released: nothing to wake
                    shutdown()
        with self._cond:
            self._cond.wait_for(lambda: not self._active, timeout_s)


class _TwoPartBody:
    """A seekable file-like body over (header, payload) memoryviews, the payload possibly in segments
    (each a part of the body, in order): botocore hashes and sends it without a joined copy.  ``read``
    returns memoryview slices, whole parts at a time when asked for less, so urllib3's 16 KiB reads become
    one ``sendall`` per part."""

    def __init__(self, header: bytes, payload: memoryview | Segments, guard: _ReadGuard):
        self._parts = [memoryview(header), *(payload.parts if isinstance(payload, Segments) else [payload])]
        self._starts = list(itertools.accumulate((p.nbytes for p in self._parts), initial=0))
        self._len = self._starts[-1]
        self._pos = 0
        self._guard = guard

    def __len__(self) -> int:
        return self._len

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = min(max(base + pos, 0), self._len)
        return self._pos

    def readinto(self, m: Any) -> int:
        """Fill ``m`` (at most its length, as the protocol says; ``read`` may return more, for urllib3's
        sake).  Readers that copy into their own buffer use this: awscrt's input stream, which botocore
        uses when ``awscrt`` is installed, assigns ``read``'s result into a fixed-size view."""
        dst = memoryview(m).cast("B")
        n = 0
        while n < dst.nbytes and self._pos < self._len:
            chunk = self.read(dst.nbytes - n)
            k = min(chunk.nbytes, dst.nbytes - n)
            dst[n:n + k] = chunk[:k]
            self._pos -= chunk.nbytes - k  # give back what read() took beyond the space
            n += k
        return n

    def read(self, n: int = -1) -> memoryview:
        if self._guard.cancelled:  # the batch gave up: stop reading the caller's buffer
            raise _Cancelled
        i = min(bisect.bisect_right(self._starts, self._pos), len(self._parts)) - 1  # the part holding _pos
        chunk = self._parts[i][self._pos - self._starts[i]:]
        if n is not None and n >= 0:
            chunk = chunk[: max(n, 1 << 24)]
        self._pos += chunk.nbytes
        return chunk


class _Redactor(logging.Filter):
    """Replaces configured secrets in botocore's log records (its DEBUG output prints signed headers)."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            msg = record.getMessage()
            if any(s in msg for s in self.secrets):
                for s in self.secrets:
                    msg = msg.replace(s, "***")
                record.msg, record.args = msg, ()
        return True


_REDACTOR = _Redactor()


def _guard_logs(secrets: set[str]) -> None:
    """Scrub ``secrets`` from every botocore / boto3 / urllib3 logger (a filter on a logger does not
    reach its children, so each one gets it; they all exist once a client has been built)."""
    _REDACTOR.secrets |= secrets
    names = [n for n in logging.root.manager.loggerDict if n.split(".")[0] in ("botocore", "boto3", "urllib3")]
    for n in (*names, "botocore", "boto3", "urllib3"):
        lg = logging.getLogger(n)
        if _REDACTOR not in lg.filters:
            lg.addFilter(_REDACTOR)


class S3Backend(StorageBackend):
    """Blocks as S3 objects; batches run on a pool of ``max_workers`` threads sharing one boto3 client."""

    Options = S3Options
    prefix_probe = "bisect"  # each HEAD is a request: probe O(log n) keys of a chain, not all of them
    writes_segments = True  # a put's body streams a payload's segments in order (_TwoPartBody)
    counts_tenants = True  # a marker object per tenant block (see the module docstring)
    options: S3Options

    def __init__(self, options: S3Options | dict[str, Any] | None = None, *, name: str | None = None):
        super().__init__(options, name=name or "s3")
        import boto3
        import botocore.session
        from botocore.config import Config

        o = self.options
        self._prefix = o.prefix.strip("/") + "/" if o.prefix.strip("/") else ""
        self._bucket = o.bucket
        secret = {k: getattr(o, k).get_secret_value() for k in
                  ("access_key_id", "secret_access_key", "session_token") if getattr(o, k) is not None}
        core = botocore.session.get_session()
        # botocore's models and endpoint rules, parsed once per process: parsing them is most of the cost of
        # a client (0.19 of 0.26 s here), paid again by every backend, on every TP rank and in every test.
        core.register_component("data_loader", _data_loader(core.get_config_variable("data_path")))
        session = boto3.session.Session(
            aws_access_key_id=secret.get("access_key_id"),
            aws_secret_access_key=secret.get("secret_access_key"),
            aws_session_token=secret.get("session_token"), region_name=o.region, botocore_session=core)
        self._secrets = {v for v in secret.values() if len(v) >= 8}
        with contextlib.suppress(Exception):  # the chain's own credentials are scrubbed too
            creds = session.get_credentials()
            if creds is not None:
                frozen = creds.get_frozen_credentials()
                self._secrets |= {v for v in (frozen.access_key, frozen.secret_key, frozen.token)
                                  if v and len(v) >= 8}
        when = "when_supported" if o.transport_checksums else "when_required"
        config = Config(connect_timeout=o.timeout_s, read_timeout=o.timeout_s,
                        retries={"total_max_attempts": o.retries + 1, "mode": "standard"},
                        max_pool_connections=o.max_workers, s3={"addressing_style": o.addressing_style},
                        request_checksum_calculation=when, response_checksum_validation=when)
        self._client = session.client("s3", endpoint_url=o.endpoint_url,
                                      region_name=session.region_name or "us-east-1", config=config)
        _guard_logs(self._secrets)
        # botocore asks for "100 Continue" before sending any file-like body, costing a round trip per
        # PUT; a block is small enough that sending it to a server that then refuses it is cheaper.
        self._client.meta.events.register_last("before-call.s3", _no_expect_header)
        self._pool = kvthreads.pool(o.max_workers, f"kvtier-s3-{self.name}")
        self.call_budget_s = (o.retries + 1) * o.timeout_s + sum(min(2**i, 20) for i in range(o.retries))
        self._usage_cache: tuple[float, dict[str, Any]] | None = None
        if o.create_bucket:
            self._call(self._ensure_bucket)

    def __repr__(self) -> str:
        o = self.options
        return f"S3Backend(name={self.name!r}, bucket={o.bucket!r}, prefix={self._prefix!r}, " \
               f"endpoint_url={o.endpoint_url!r})"

    # ------------------------------------------------------------------ hooks

    def _put_blocks(self, keys: Sequence[str], payloads: Sequence[memoryview | Segments],
                    layout_id: int) -> list[bool]:
        # Frame in the workers: each payload is checksummed right before it is sent, in parallel.
        guard = _ReadGuard()
        return self._batch(keys, lambda i: self._put_one(
            keys[i], self._frame(keys[i], payloads[i], layout_id), guard), guard, writes=True)

    def _get_blocks(self, keys: Sequence[str], payloads: Sequence[memoryview],
                    layout_id: int) -> list[bool | str]:
        guard = _ReadGuard()

        def one(i: int) -> bool | str:
            header = memoryview(bytearray(self.header_size))
            size = self._get_one(keys[i], (header, payloads[i]), guard)
            return False if size is None else (self._verify(keys[i], size, header, payloads[i], layout_id) or True)

        return self._batch(keys, one, guard)

    def _write(self, keys: Sequence[str], values: Sequence[tuple[bytes, memoryview | Segments]]) -> list[bool]:
        guard = _ReadGuard()
        return self._batch(keys, lambda i: self._put_one(keys[i], values[i], guard), guard, writes=True)

    def _read_into(self, keys: Sequence[str], headers: Sequence[memoryview],
                   payloads: Sequence[memoryview]) -> list[int | None]:
        guard = _ReadGuard()
        return self._batch(keys, lambda i: self._get_one(keys[i], (headers[i], payloads[i]), guard), guard)

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        return self._batch(keys, lambda i: self._head(keys[i]), None)

    def _delete(self, keys: Sequence[str]) -> int:
        present = [k for k, ok in zip(keys, self._exists(keys)) if ok]
        # A quota's trim of a tenant's share: its markers go in the same requests (absent ones are no error).
        markers = [self._marker(Share(k.partition("/")[0], t), k) for k in keys if (t := self._put_tenant(k))]
        self._delete_objects([self._prefix + k for k in present] + markers)
        return len(present)

    def _delete_objects(self, objects: list[str]) -> None:
        """Delete these object keys (the backend's prefix included), ``_DELETE_BATCH`` a request, on the pool."""
        groups = [objects[i:i + _DELETE_BATCH] for i in range(0, len(objects), _DELETE_BATCH)]
        self._batch(groups, lambda i: self._delete_group(groups[i]), None)

    def _scan(self, prefix: str) -> Iterator[StoredBlock]:
        """Every object under ``prefix`` up to the tenants' markers, which are no blocks: they sort after
        every namespace (hex ids), so a whole-store listing stops at the first one instead of paging
        through them all."""
        cut = len(self._prefix)
        markers = self._prefix + _MARKERS
        for obj in self._list(self._prefix + prefix):
            if obj["Key"] >= markers:
                return
            yield StoredBlock(obj["Key"][cut:], obj["Size"])

    def _list(self, prefix: str) -> Iterator[dict[str, Any]]:
        """ListObjectsV2 entries under the object key ``prefix`` (the backend's prefix included), in key
        order, one request per 1000."""
        for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self._bucket, Prefix=prefix):
            yield from page.get("Contents", ())

    def _namespace_blocks(self, namespace_id: str) -> list[StoredBlock]:
        """One namespace's blocks (its tenants' included), oldest written first (``kvtier.quota``: S3
        records no reads, so a share over its quota loses the blocks written longest ago)."""
        cut = len(self._prefix)
        listed = [(obj["LastModified"], obj["Key"][cut:], obj["Size"])
                  for obj in self._list(f"{self._prefix}{namespace_id}/")]
        listed.sort()
        return [StoredBlock(k, n) for _, k, n in listed if invalid_key([k]) is None]

    # ------------------------------------------------------------------ tenants (kvtier.quota)

    def _marker(self, share: Share, key: str) -> str:
        """The object key of a tenant block's marker."""
        return f"{self._prefix}{_MARKERS}{share.namespace}/{share.tenant}/{key.partition('/')[2]}"

    def _record_tenants(self, stored: Mapping[Share, list[str]]) -> None:
        """A zero-byte marker per stored tenant block, on the pool, within the call budget; a failure of
        any raises (the base class logs and counts it; the put stands)."""
        markers = [self._marker(share, k) for share, keys in stored.items() for k in keys]
        self._batch(markers, lambda i: self._client.put_object(Bucket=self._bucket, Key=markers[i], Body=b""),
                    None)

    def _tenant_records(self, namespace_id: str) -> dict[str, str]:
        """The namespace's markers, as block key -> tenant tag (read only: stale markers stay)."""
        root = f"{self._prefix}{_MARKERS}{namespace_id}/"
        out: dict[str, str] = {}
        for obj in self._list(root):
            tag, _, h = obj["Key"][len(root):].partition("/")
            out[f"{namespace_id}/{h}"] = tag
        return out

    def _share_blocks(self, share: Share) -> list[StoredBlock]:
        """A tenant's blocks (those with its marker), or a namespace's untenanted blocks (those with no
        marker of any of its tenants), oldest written first.  The markers are listed before the blocks,
        so a marker whose block that listing lacks is stale: it is dropped (best effort)."""
        root = f"{self._prefix}{_MARKERS}{share.namespace}/"
        marked: dict[str, str] = {}  # block key -> its marker's object key
        for obj in self._list(root if share.tenant is None else f"{root}{share.tenant}/"):
            marked[f"{share.namespace}/{obj['Key'].rpartition('/')[2]}"] = obj["Key"]
        blocks = self._namespace_blocks(share.namespace)
        stored = {b.key for b in blocks}
        stale = [m for k, m in marked.items() if k not in stored]
        if stale:
            try:
                self._delete_objects(stale)
            except Exception as e:  # noqa: BLE001 - the count stands; the next one drops them
                log.info("backend %r: could not drop %d stale tenant marker(s) (%s)", self.name, len(stale),
                         type(e).__name__)
        if share.tenant is None:
            return [b for b in blocks if b.key not in marked]
        return [b for b in blocks if b.key in marked]

    def _get_object(self, key: str) -> dict[str, Any] | None:
        """GetObject's response, or None when the object does not exist (any other error raises)."""
        try:
            resp: dict[str, Any] = self._client.get_object(Bucket=self._bucket, Key=self._prefix + key)
            return resp
        except Exception as e:
            if _is_missing(e):
                return None
            raise

    def _read_small(self, key: str) -> bytes | None:
        def get() -> bytes | None:
            resp = self._get_object(key)
            if resp is None:
                return None
            with contextlib.closing(resp["Body"]) as body:
                data: bytes = body.read()
            return data

        got: bytes | None = self._batch([key], lambda i: get(), None)[0]
        return got

    def _write_small(self, key: str, data: bytes) -> None:
        self._batch([key], lambda i: self._client.put_object(
            Bucket=self._bucket, Key=self._prefix + key, Body=bytes(data)), None)

    def _health(self) -> None:
        self._batch([self._bucket], lambda i: self._client.head_bucket(Bucket=self._bucket), None)

    def _usage(self) -> dict[str, Any]:
        """Blocks and bytes under the prefix, from a listing reused for ``usage_ttl_s`` and cut at
        ``usage_max_objects`` (then marked partial): stats() must stay cheap on a huge bucket."""
        now = time.monotonic()
        if self._usage_cache is None or now - self._usage_cache[0] >= self.options.usage_ttl_s:
            cap = self.options.usage_max_objects
            listed = list(itertools.islice(self._scan(""), cap + 1))
            sizes = [b.size for b in listed[:cap] if key_problem(b.key) is None]
            usage: dict[str, Any] = {"blocks": len(sizes), "bytes": sum(sizes)}
            if len(listed) > cap:
                usage["partial"] = True
            self._usage_cache = (now, usage)
        return dict(self._usage_cache[1])

    def _close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # ------------------------------------------------------------------ one request each

    def _put_one(self, key: str, value: tuple[bytes, memoryview | Segments], guard: _ReadGuard) -> bool:
        body = _TwoPartBody(value[0], value[1], guard)
        self._client.put_object(Bucket=self._bucket, Key=self._prefix + key, Body=body,
                                ContentLength=len(body))
        return True

    def _get_one(self, key: str, bufs: tuple[memoryview, memoryview], guard: _ReadGuard) -> int | None:
        resp = self._get_object(key)
        if resp is None:
            return None
        body = resp["Body"]
        size = int(resp["ContentLength"])  # S3 always announces it; its absence fails loudly
        # Untyped botocore / urllib3 internals (None where absent): urllib3's response under the body, and
        # the http.client.HTTPResponse under that, whose readinto fills our buffer in place.
        raw: Any = getattr(body, "_raw_stream", None)
        fp: Any = getattr(raw, "_fp", None)
        direct = fp is not None and hasattr(fp, "readinto") and not raw.headers.get("content-encoding")
        readinto = fp.readinto if direct else _copying_readinto(body)
        # Fill what fits; a longer value is left unread (its length alone makes it a miss upstream).
        want = [min(bufs[0].nbytes, size), min(bufs[1].nbytes, max(size - bufs[0].nbytes, 0))]
        clean = False
        try:
            with guard.reading(_shutdown_of(raw)):
                for buf, n in zip(bufs, want):
                    if n and _fill(readinto, buf[:n]) < n:
                        # Never report a truncated transfer as the stored length: that would make a
                        # good block look corrupt and get it deleted.
                        raise ConnectionError(f"response body ended early ({size} bytes announced)")
            clean = direct and sum(want) == size and fp.isclosed()
        finally:
            if clean:
                raw.release_conn()  # fully read: the connection goes back to the pool
            else:
                body.close()  # unread bytes or a failed read: drop the connection
        return size

    def _head(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self._bucket, Key=self._prefix + key)
            return True
        except Exception as e:
            if _is_missing(e):
                return False
            raise

    def _delete_group(self, objects: list[str]) -> None:
        """One DeleteObjects request for these object keys (the backend's prefix included)."""
        resp = self._client.delete_objects(Bucket=self._bucket, Delete={
            "Objects": [{"Key": k} for k in objects], "Quiet": True})
        errors = [e for e in resp.get("Errors", ()) if e.get("Code") not in _MISSING]
        if errors:
            raise OSError(f"DeleteObjects failed for {len(errors)} key(s), first "
                          f"{errors[0].get('Key')!r}: {errors[0].get('Code')}")

    def _ensure_bucket(self) -> None:
        region = self._client.meta.region_name
        kw: dict[str, Any] = {} if region == "us-east-1" else {
            "CreateBucketConfiguration": {"LocationConstraint": region}}
        try:
            self._client.create_bucket(Bucket=self._bucket, **kw)
        except Exception as e:
            if _error_code(e) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise

    # ------------------------------------------------------------------ batching

    def _batch(self, items: Sequence[Any], fn: Callable[[int], Any], guard: _ReadGuard | None,
               writes: bool = False) -> list[Any]:
        """Run ``fn(i)`` for every item on the pool, in order, within ``call_budget_s``.

        A put that fails on some keys reports False for them (logged); otherwise, and for every other
        operation, the first error is raised (the base class types it) -- a read error is never a miss."""
        if not items:
            return []
        futures = [self._pool.submit(fn, i) for i in range(len(items))]
        done, pending = wait(futures, timeout=self.call_budget_s)
        if pending:
            if guard is not None:
                guard.cancel(self.options.timeout_s)
            for f in pending:
                f.cancel()
        errors = [exc for f in futures if f in done and (exc := f.exception()) is not None]
        failed = len(errors) + len(pending)
        if failed and (not writes or failed == len(futures)):
            if errors:
                raise self._scrub(errors[0])
            raise TimeoutError(f"{len(pending)} of {len(items)} request(s) still unanswered after the "
                               f"call budget of {self.call_budget_s:g}s")
        if failed:
            log.warning("backend %r: %d of %d put(s) failed, first: %s", self.name, failed, len(items),
                        self._scrub(errors[0]) if errors else "call budget exceeded")
        return [f.result() if f in done and f.exception() is None else False for f in futures]

    def _scrub(self, e: BaseException) -> BaseException:
        """``e``, or if its message holds a credential, a scrubbed copy, of the builtin type it translates to."""
        text = str(e)
        if not any(s in text for s in self._secrets):
            return e
        for s in self._secrets:
            text = text.replace(s, "***")
        typed = self._translate_error(e) if isinstance(e, Exception) else e
        kind = type(typed) if type(typed) in (TimeoutError, ConnectionError, PermissionError) else RuntimeError
        return kind(f"{type(e).__name__}: {text}")

    def _location(self) -> str:
        return f"s3://{self._bucket}/{self._prefix}"

    def _translate_error(self, e: Exception) -> Exception:
        """botocore's exceptions as the builtin ones the base class types (by class, never by text)."""
        from botocore import exceptions as bx

        if isinstance(e, (bx.ReadTimeoutError, bx.ConnectTimeoutError)) or _error_code(e) == "RequestTimeout":
            return TimeoutError(str(e))
        if isinstance(e, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError)) or \
                _error_code(e) in _UNAVAILABLE:
            return ConnectionError(str(e))
        if isinstance(e, bx.NoCredentialsError) or _error_code(e) in _DENIED:
            return PermissionError(errno.EACCES, str(e), self._location())
        return e


def _no_expect_header(params: dict[str, Any], **kwargs: Any) -> None:
    params.get("headers", {}).pop("Expect", None)


def _error_code(e: BaseException) -> str | None:
    resp = getattr(e, "response", None)
    return str(resp.get("Error", {}).get("Code")) if isinstance(resp, dict) else None


def _is_missing(e: BaseException) -> bool:
    return _error_code(e) in _MISSING


def _shutdown_of(raw: Any) -> Callable[[], None] | None:
    """How to wake a thread blocked reading ``raw`` (a urllib3 response): shut its socket down."""
    if callable(getattr(raw, "_sock_shutdown", None)):  # urllib3 >= 2.3 keeps it for this purpose
        shutdown: Callable[[], None] = raw.shutdown
        return shutdown
    sock = getattr(getattr(raw, "connection", None), "sock", None)
    return (lambda: sock.shutdown(socket.SHUT_RDWR)) if sock is not None else None


def _fill(readinto: Callable[[memoryview], int], buf: memoryview) -> int:
    """Read into ``buf`` until it is full or the body ends; return the bytes read."""
    pos = 0
    while pos < buf.nbytes:
        n = readinto(buf[pos:pos + _READ_CHUNK])
        if not n:
            break
        pos += n
    return pos


def _copying_readinto(body: Any) -> Callable[[memoryview], int]:
    """Fallback for bodies without a raw ``readinto`` (e.g. content-encoded): read, then copy."""
    def readinto(mv: memoryview) -> int:
        data = body.read(mv.nbytes)
        mv[:len(data)] = data
        return len(data)
    return readinto

