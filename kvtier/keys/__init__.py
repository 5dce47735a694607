"""Block keys: what a block is called, on any host, in any process.

A prompt is cut into full blocks of ``block_size`` tokens.  Block ``i``'s hash is

    h[i] = H(h[i-1] or NONE, tokens[i*B:(i+1)*B], extra[i])

where ``extra[i]`` is a tuple of tagged extra keys, in this order:
``("lora", name, path)``, one ``("mm", identifier, offset - block_start)`` per multimodal item that
overlaps the block, and ``("cache_salt", salt)`` on block 0 only; ``None`` when there are none.

Two algorithms:

* ``sha256_cbor`` is byte-identical to vLLM's (>= 0.33) prefix-caching hash:
  ``H(x) = sha256(cbor2.dumps(x, canonical=True))`` with ``x = (parent, tuple(tokens), extra)`` and
  ``NONE = H(seed)``, seed = ``PYTHONHASHSEED`` if set else ``"vllm-none-hash"``.  We emit the canonical
  CBOR ourselves, vectorised with numpy, so the result is the same bytes at a fraction of the cost.
* ``xxh3_128``: a seeded 128-bit hash of ``parent || int64-LE tokens || cbor(extra)`` for deployments
  that do not need vLLM compatibility.
* ``sglang_sha256`` is byte-identical to SGLang's HiCache page keys (``get_storage_hash_str``):
  ``h[i] = sha256(h[i-1] || uint32-LE tokens)`` (a page holding a token id >= 2**32:
  ``sha256(h[i-1] || 0xff || uint64-LE tokens)``), where the chain starts from nothing, or from SGLang's
  request namespace seed ``sha256("sglang-cache-namespace-v1" || part(extra_key) || part(cache_salt))`` when
  either is set (``part(None) = 0x00``, ``part(s) = 0x01 || u64-LE len(utf8) || utf8``).  The ``seed`` is
  SGLang's ``extra_key`` (its LoRA id appended, as SGLang does); multimodal items and LoRA are not extra
  keys there (SGLang folds them into token ids / ``extra_key``), so they are refused.

Never Python's ``hash()``: it differs per process.
"""

from .cbor import sha256_cbor, sha256_cbor_frames
from .hasher import (
    ALGORITHMS,
    SGLANG_SHA256,
    VLLM_DEFAULT_SEED,
    BlockHasher,
    Extras,
    SequenceHasher,
    known_algo,
    none_hash_seed,
    sglang_namespace_seed,
    sglang_sha256_chain,
)
from .namespace import BLOCK_FORMAT_VERSION, CANONICAL_PAYLOAD, HEAD_MAJOR_KINDS, Namespace, tenant_tag
from .stored import KEY_FORMAT, MANIFEST_NAME, invalid_key, key_problem, show_key, split_key
from .tokens import ExtraKey, LoRA, LoraKey, MMItem, SaltKey, as_token_array, validate_mm_items

# One room per part: tokens.py (what a block is made of, checked), cbor.py (vLLM's hash, vectorised),
# hasher.py (the chains), namespace.py (what makes bytes interchangeable), stored.py (keys as backends
# see them).  Everything is imported from here.
__all__ = ["ALGORITHMS", "BLOCK_FORMAT_VERSION", "CANONICAL_PAYLOAD", "HEAD_MAJOR_KINDS", "KEY_FORMAT",
           "MANIFEST_NAME", "SGLANG_SHA256", "VLLM_DEFAULT_SEED", "BlockHasher", "ExtraKey", "Extras", "LoRA",
           "LoraKey", "MMItem", "Namespace", "SaltKey", "SequenceHasher", "as_token_array", "invalid_key",
           "key_problem", "known_algo", "none_hash_seed", "sglang_namespace_seed", "sglang_sha256_chain",
           "sha256_cbor", "sha256_cbor_frames", "show_key", "split_key", "tenant_tag", "validate_mm_items"]
