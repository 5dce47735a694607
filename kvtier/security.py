"""Provenance of stored KV: sealing a block's value (modes ``authenticate`` and ``encrypt``) and opening it.

A checksum catches damage, not intent: whoever can write a shared store can write a well-formed value with
other KV under any key, even one of a prompt nobody sent yet.  A backend whose mode is not ``none`` stores
format version 2 values (``kvtier.format.blockformat``) sealed with AES-256-GCM under a key only holders of the
deployment key can derive, and serves a value only when its tag verifies.

Invariants:
* A sealed backend serves a value only when it is a version 2 value of the backend's own mode whose tag
  verifies under the key derived for (that key id, that mode, the value's namespace digest, this
  deployment's tenant).  Anything else is a miss: :class:`Forged` when the header is intact (a version 1
  value, another mode, an unknown key id, a copy from another key, a bad tag), a plain reason (corrupt)
  when the framing itself is damaged; either way the backend counts and deletes it (``get_into``).
* A value sealed in one mode never opens in the other: the mode byte is covered by the tag and is an input
  of the key derivation.  Version 1 values (mode ``none``) never open in a sealed mode.
* Key material lives only in :class:`KeyRing` objects and the ciphers made from it: no ``repr``, ``str``,
  error message, log line, metric or config object holds it (the config holds where keys are, never keys).
  Errors name the file or variable, never what it holds.
* Key derivation (HKDF-SHA256): deployment key -> tenant key (``info`` names the tenant by its
  ``cache_salt``'s SHA-256, or "no tenant") -> value key per (mode, namespace digest).  A deployment given
  a tenant key (``security.tenant_keys``) holds no deployment key, so it cannot make another tenant's
  values: their keys derive from a tenant key it cannot compute.
* Nonces are 96 random bits per value (``os.urandom``): GCM's bound for random nonces is 2**32 values per
  key; each (tenant, mode, namespace) has its own key, and rotation (``write_key``) starts a fresh one.
* ``cryptography`` is imported only when a sealed mode is used: mode ``none`` needs no extra package.
* Key objects are made once per (key id, mode, namespace) and kept in the ring: the ``AESGCM`` object
  (which keeps its initialised cipher context: a one-shot call costs about 2 us) and ``algorithms.AES``
  (for the streamed path, which still needs a ``Cipher`` per nonce).
* A value put as segments (``blockformat.Segments``: a group of engine blocks in separate host slots) is
  sealed without joining them: streamed over the parts, the same tag and ciphertext as over their bytes
  joined, so the stored value does not depend on how the payload lay in memory.
* A landing buffer (:meth:`Seal.landing`) is private to the reading thread and holds ciphertext only; the
  plaintext is written into the caller's buffer by one decryption that checks the tag.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, overload

from .format import blockformat as bf
from .keys import split_key

if TYPE_CHECKING:
    from typing_extensions import Buffer

Mode = Literal["none", "authenticate", "encrypt"]
MODE_CODES: dict[str, int] = {"authenticate": bf.MODE_AUTHENTICATE, "encrypt": bf.MODE_ENCRYPT}
_MODE_NAMES = {v: k for k, v in MODE_CODES.items()}
MIN_KEY_BYTES = 32
_NONCE = 12
_GCM_SPARE = 15  # a block less a byte: the room cryptography's update_into wants beyond its input
_SEALED_PREFIX = bf.MAGIC + bf.FORMAT_VERSION_SEALED.to_bytes(2, "little")  # a version 2 header's first bytes


class Forged(str):
    """Why a value is not served, when its header is intact but it is not a value this deployment sealed:
    counted in ``BackendStats.forged`` (not ``corrupt``) and deleted, never served."""

    __slots__ = ()


class KeySourceError(ValueError):
    """A key source that cannot be used; the message names the source, never its content."""


def parse_key_text(raw: bytes, where: str) -> bytes:
    """Key material from a file's or variable's text: hex (``openssl rand -hex 32``) or base64
    (``openssl rand -base64 32``), at least 32 bytes once decoded."""
    import base64
    import binascii

    text = raw.strip()
    if not text:
        raise KeySourceError(f"{where} is empty; expected a key of {MIN_KEY_BYTES} or more random bytes as hex "
                        "(openssl rand -hex 32) or base64 (openssl rand -base64 32)")
    key: bytes | None = None
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        try:
            key = base64.b64decode(text, validate=True)
        except (ValueError, binascii.Error):
            key = None
    if key is None:
        raise KeySourceError(f"{where} holds no hex or base64 text; expected a key of {MIN_KEY_BYTES} or more random "
                        "bytes as hex (openssl rand -hex 32) or base64 (openssl rand -base64 32)")
    if len(key) < MIN_KEY_BYTES:
        raise KeySourceError(f"{where} holds a key of {len(key)} bytes; expected at least {MIN_KEY_BYTES} "
                        "(openssl rand -hex 32)")
    return key


def read_key(file: str | None, env: str | None, environ: Mapping[str, str] | None = None) -> bytes:
    """The key material a ``security.keys`` entry points at (exactly one of ``file`` / ``env``)."""
    if file is not None:
        path = os.path.expanduser(os.path.expandvars(file))
        try:
            with open(path, "rb") as f:
                raw = f.read(1 << 16)
        except OSError as e:
            raise KeySourceError(f"cannot read key file {file}: {e.strerror or type(e).__name__}") from None
        return parse_key_text(raw, f"key file {file}")
    assert env is not None
    value = (os.environ if environ is None else environ).get(env)
    if value is None:
        raise KeySourceError(f"environment variable {env} is not set")
    return parse_key_text(value.encode("utf-8", "replace"), f"environment variable {env}")


def _hkdf(secret: bytes, info: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(hashes.SHA256(), 32, None, info).derive(secret)


def derive_tenant_key(deployment_key: bytes, tenant: str | None) -> bytes:
    """The tenant key of ``tenant`` (a ``cache_salt``; None: the deployment's values of no tenant)."""
    who = b"\x01" + hashlib.sha256(tenant.encode()).digest() if tenant is not None else b"\x00"
    return _hkdf(deployment_key, b"kvtier tenant key v1\x00" + who)


class KeyRing:
    """The keys one deployment reads with (several, during a rotation) and the one it writes with, each
    already narrowed to this deployment's tenant.  Value keys are derived on first use and kept."""

    def __init__(self, keys: Mapping[int, bytes], write_id: int, tenant: str | None = None,
                 tenant_keys: bool = False):
        if write_id not in keys:
            raise ValueError(f"write key id {write_id} is not among the key ids {sorted(keys)}")
        # Tenant keys straight from the config, or derived here from the deployment keys.
        self._tenant_keys = {i: (k if tenant_keys else derive_tenant_key(k, tenant)) for i, k in keys.items()}
        self.write_id = write_id
        self.ids = tuple(sorted(keys))
        self.tenant_set = tenant is not None
        self._values: dict[tuple[int, int, bytes], tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"KeyRing(ids={list(self.ids)}, write_id={self.write_id}, tenant={'set' if self.tenant_set else 'none'})"

    __str__ = __repr__

    def __reduce__(self) -> Any:  # never pickled: a key would travel in the pickle
        raise TypeError("a KeyRing is not picklable (it holds key material); build it from the config")

    def value_key(self, key_id: int, mode: int, namespace_digest: bytes) -> tuple[Any, Any] | None:
        """(``AESGCM``, ``algorithms.AES``) of the value key of ``mode`` in that namespace sealed with key
        ``key_id``, both reusable across values (the streamed path needs a ``Cipher`` per nonce, but not a
        new key object); None when this deployment holds no such key."""
        slot = (key_id, mode, namespace_digest)
        got = self._values.get(slot)
        if got is not None:
            return got
        tenant_key = self._tenant_keys.get(key_id)
        if tenant_key is None:
            return None
        from cryptography.hazmat.primitives.ciphers import algorithms
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        raw = _hkdf(tenant_key, b"kvtier value key v1\x00" + bytes([mode]) + namespace_digest)
        got = (AESGCM(raw), algorithms.AES(raw))
        with self._lock:
            return self._values.setdefault(slot, got)


def _parts(payload: memoryview | bf.Segments) -> list[memoryview]:
    return payload.parts if isinstance(payload, bf.Segments) else [payload]


class Seal:
    """How one backend seals the values it writes and opens those it reads (mode authenticate or encrypt).

    Construction, per value (AES-256-GCM with the value key, a random 96-bit nonce, ``aad`` = header bytes
    0..88, which hold the mode, key id, nonce, namespace, block hash, layout and lengths):
    * encrypt: the stored payload is GCM's ciphertext of the payload with ``aad`` as associated data; the
      tag goes in the header.
    * authenticate (GMAC-style): GCM over the payload as associated data and ``aad`` as the message; the
      tag goes in the header, the payload is stored as is (the encrypted ``aad`` is thrown away).  A tag is
      a GCM tag over (payload, E(aad)): forging one is forging GCM, and E is a bijection, so it binds
      the header as it binds the payload.  One GCM call over the payload, AES-NI and carry-less multiply:
      the fastest keyed MAC measured here (``kvtier bench backends``, docs/performance.md)."""

    header_size = bf.SEALED_HEADER_SIZE

    def __init__(self, mode: str, keyring: KeyRing):
        if mode not in MODE_CODES:
            raise ValueError(f"security mode: expected authenticate or encrypt, got {mode!r}")
        self.mode = mode
        self.code = MODE_CODES[mode]
        self.keyring = keyring
        self._landings = threading.local()
        # Imported once here (a sealed mode is in use), not per value: the two ``from`` imports in the
        # decryption path cost about 2 us a value under the GIL (measured: 4.8-5.3 against 6.7-8.6 us of
        # work beside a 256 KiB ``decrypt_into`` of 25 us).
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        self._invalid_tag, self._cipher, self._gcm = InvalidTag, Cipher, modes.GCM

    def __repr__(self) -> str:
        return f"Seal(mode={self.mode!r}, keys={list(self.keyring.ids)}, write_key={self.keyring.write_id})"

    @overload
    def seal(self, key: str, payload: memoryview, layout_id: int) -> tuple[bytes, memoryview]: ...

    @overload
    def seal(self, key: str, payload: bf.Segments, layout_id: int) -> tuple[bytes, memoryview | bf.Segments]: ...

    def seal(self, key: str, payload: memoryview | bf.Segments,
             layout_id: int) -> tuple[bytes, memoryview | bf.Segments]:
        """(header, stored payload) for ``payload`` under ``key``: the payload itself when authenticating
        (segments stay segments), a new buffer of ciphertext when encrypting (the caller's buffers are
        never changed)."""
        ns, h = split_key(key)
        ring = self.keyring
        aead, aes = ring.value_key(ring.write_id, self.code, ns)  # type: ignore[misc]  # write_id is held
        nonce = os.urandom(_NONCE)
        n = payload.nbytes
        aad = bf.encode_sealed_aad(ns, h, layout_id, n, self.code, ring.write_id, nonce)
        if isinstance(payload, bf.Segments):
            if len(payload.parts) > 1:
                return self._seal_parts(aes, nonce, aad, payload)
            payload = payload.parts[0]
        if self.code == bf.MODE_AUTHENTICATE:
            return bf.finish_sealed_header(aad, aead.encrypt(nonce, aad, payload)[-bf.TAG_SIZE:]), payload
        out = bytearray(n + bf.TAG_SIZE)
        aead.encrypt_into(nonce, payload, aad, out)
        view = memoryview(out)
        return bf.finish_sealed_header(aad, view[n:]), view[:n]

    def _seal_parts(self, aes: Any, nonce: bytes, aad: bytes,
                    payload: bf.Segments) -> tuple[bytes, memoryview | bf.Segments]:
        """``seal`` of a payload in several buffers, streamed over them: GCM is a stream, so the tag (and
        the ciphertext) are those of the parts' bytes joined, without joining them.  Measured at 4 parts
        of 256 KiB (one 1 MiB grouped value, 2 cores): authenticate 428 us streamed against 523 us for a
        join then the one-shot call; encrypt 759 us streamed into the ciphertext buffer against 3.2 ms
        for a join then ``encrypt_into`` (two fresh 1 MiB buffers, both faulted in).  So no join here."""
        if self.code == bf.MODE_AUTHENTICATE:
            enc = self._cipher(aes, self._gcm(nonce)).encryptor()
            for part in payload.parts:
                enc.authenticate_additional_data(part)
            enc.update(aad)
            enc.finalize()
            return bf.finish_sealed_header(aad, enc.tag), payload
        n = payload.nbytes
        # update_into wants room for a block more than it is given (cryptography's contract): 15 spare bytes.
        out = memoryview(bytearray(n + _GCM_SPARE))
        enc = self._cipher(aes, self._gcm(nonce)).encryptor()
        enc.authenticate_additional_data(aad)
        at = 0
        for part in payload.parts:
            at += enc.update_into(part, out[at:])
        enc.finalize()
        return bf.finish_sealed_header(aad, enc.tag), out[:n]

    def landing(self, payload: memoryview | bf.Segments) -> memoryview | None:
        """Where a reader should put the stored payload of a value to be opened into ``payload``: in mode
        encrypt with ``payload`` one buffer, this thread's landing buffer (``payload.nbytes + TAG_SIZE``
        bytes; the reader fills the first ``payload.nbytes``, then passes it to :meth:`open` as ``stored``),
        so the value is decrypted into ``payload`` by one ``AESGCM.decrypt_into`` (no cipher context per
        value, which costs a seventh of a 256 KiB block's decryption); else None: read into ``payload``.
        One buffer per reading thread, grown to the largest value it read and kept (a batch's threads are
        long-lived pool threads)."""
        if self.code != bf.MODE_ENCRYPT or not isinstance(payload, memoryview):
            return None
        want = payload.nbytes + bf.TAG_SIZE
        buf: bytearray | None = getattr(self._landings, "buf", None)
        if buf is None or len(buf) < want:
            buf = self._landings.buf = bytearray(want)
        return memoryview(buf)[:want]

    def open(self, key: str, size: int, header: Buffer, payload: memoryview | bf.Segments,
             layout_id: int, stored: memoryview | None = None) -> str | None:
        """Why the stored value read as (header, payload), ``size`` bytes in all, is not to be served under
        ``key`` (a :class:`Forged` reason when its header is intact), or None: then ``payload`` holds the
        block's bytes (decrypted in place in mode encrypt).  ``stored``: the :meth:`landing` buffer the
        stored payload was read into instead of ``payload`` (mode encrypt): decrypted from there into
        ``payload``."""
        if stored is not None and (self.code != bf.MODE_ENCRYPT or not isinstance(payload, memoryview)):
            raise ValueError(f"a landing buffer is for mode encrypt into one buffer; this seal's mode is "
                             f"{self.mode} (Seal.landing returns None there)")
        # One copy of the header (112 bytes), read for its version, parsed, and its first 88 bytes the
        # aad: this runs per value under the GIL, beside the decryption.
        head = bytes(header)
        if head[:6] != _SEALED_PREFIX:  # not magic + version 2: say what it is
            version = bf.stored_version(head)
            if version == bf.FORMAT_VERSION:
                return Forged(f"a format version {bf.FORMAT_VERSION} value, which has no tag; "
                              f"this backend's security mode is {self.mode}")
            return "bad magic" if version is None else f"unsupported format version {version}"
        expected = bf.SEALED_HEADER_SIZE + payload.nbytes
        if size != expected:
            return f"stored value is {size} bytes, expected {expected}"
        ns, h = split_key(key)
        state, info = bf.parse_sealed_header(head, ns, h, layout_id, payload.nbytes)
        if isinstance(info, str):
            return info if state == "damaged" else Forged(info)
        mode, key_id, nonce, tag = info
        if mode != self.code:
            return Forged(f"sealed in mode {_MODE_NAMES.get(mode, mode)}; this backend's security mode is "
                          f"{self.mode}")
        found = self.keyring.value_key(key_id, mode, ns)
        if found is None:
            return Forged(f"sealed with key id {key_id}, which this deployment does not hold "
                          f"(it holds {', '.join(map(str, self.keyring.ids))})")
        aead, aes = found
        if self._tag_ok(aead, aes, nonce, head[: bf.SEALED_AAD_SIZE], tag, payload, stored):
            return None
        return Forged("tag mismatch: not sealed under this key, namespace and tenant (or altered since)")

    def _tag_ok(self, aead: Any, aes: Any, nonce: bytes, aad: bytes, tag: bytes,
                payload: memoryview | bf.Segments, stored: memoryview | None) -> bool:
        if self.code == bf.MODE_AUTHENTICATE and isinstance(payload, memoryview):
            return hmac.compare_digest(aead.encrypt(nonce, aad, payload)[-bf.TAG_SIZE:], tag)
        if stored is not None and isinstance(payload, memoryview):
            n = payload.nbytes
            if stored.nbytes != n + bf.TAG_SIZE:
                raise ValueError(f"landing buffer of {stored.nbytes} bytes for a payload of {n}; "
                                 f"expected {n + bf.TAG_SIZE} (Seal.landing)")
            stored[n:] = tag  # decrypt_into wants ciphertext || tag
            try:
                aead.decrypt_into(nonce, stored, aad, payload)
            except self._invalid_tag:
                return False
            return True

        # Streamed: a payload in several buffers, or decrypted in place (the one-shot API needs the tag
        # beside the ciphertext, and a copy of the payload to put it there).
        if self.code == bf.MODE_AUTHENTICATE:
            enc = self._cipher(aes, self._gcm(nonce)).encryptor()
            for part in _parts(payload):
                enc.authenticate_additional_data(part)
            enc.update(aad)
            enc.finalize()
            return hmac.compare_digest(enc.tag, tag)
        dec = self._cipher(aes, self._gcm(nonce, tag)).decryptor()
        dec.authenticate_additional_data(aad)
        for part in _parts(payload):
            dec.update_into(part, part)
        try:
            dec.finalize()
        except self._invalid_tag:
            return False
        return True
