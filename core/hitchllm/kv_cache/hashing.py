"""Deterministic content hashes for full KV cache blocks.

A block's hash names everything its K/V depend on: the hash of the block before it (so a hash
identifies the whole prefix), the block's token ids, and extra keys such as a LoRA adapter or a
cache salt. The bytes hashed are a fixed serialization, never Python's ``hash()``, so the same
block hashes the same in every process and every run (``PYTHONHASHSEED`` does not matter).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

# Bumped if the serialization below changes, so old and new hashes can never collide.
_DOMAIN = b"hitchllm-kv-block-v1"

# One tag byte per extra-key type keeps e.g. the int 1 and the string "1" apart.
_TAG_NONE = b"N"
_TAG_BOOL = b"B"
_TAG_INT = b"I"
_TAG_FLOAT = b"F"
_TAG_STR = b"S"
_TAG_BYTES = b"Y"
_TAG_TUPLE = b"T"


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _encode_key(key: object) -> bytes:
    """Serialize one extra key; only plain values whose bytes cannot vary between runs."""
    if key is None:
        return _TAG_NONE
    # bool before int: bool is a subclass of int but should not equal it here.
    if isinstance(key, bool):
        return _TAG_BOOL + (b"1" if key else b"0")
    if isinstance(key, int):
        return _TAG_INT + _length_prefixed(repr(key).encode("utf-8"))
    if isinstance(key, float):
        return _TAG_FLOAT + struct.pack("<d", key)
    if isinstance(key, str):
        return _TAG_STR + _length_prefixed(key.encode("utf-8"))
    if isinstance(key, bytes):
        return _TAG_BYTES + _length_prefixed(key)
    if isinstance(key, tuple):
        return _TAG_TUPLE + _encode_keys(key)
    # repr() of an arbitrary object may embed a memory address, which would make the hash
    # differ between processes; refuse rather than silently break cross-process sharing.
    raise TypeError(
        f"extra key {key!r} of type {type(key).__name__} cannot be hashed deterministically; "
        "use None, bool, int, float, str, bytes or a tuple of those"
    )


def _encode_keys(keys: tuple) -> bytes:
    return struct.pack("<Q", len(keys)) + b"".join(_encode_key(k) for k in keys)


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """Hash one full block, chained to its parent block's hash (``None`` for the first block).

    Token ids are packed as little-endian int64; ``extra_keys`` may hold None, bool, int,
    float, str, bytes and nested tuples of those. Raises ``TypeError`` for anything else.
    """
    h = hashlib.sha256(_DOMAIN)
    h.update(b"\x00" if parent is None else b"\x01" + _length_prefixed(parent))
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(_encode_keys(extra_keys))
    return h.digest()
