"""Block hashing: the contract between the engine's prefix cache and the gateway's router.

Both sides import this module; neither re-implements it.

A request's tokens are cut into blocks of `block_size` tokens. Only FULL blocks are hashed. Block
i's hash chains from block i-1's, so equal hashes mean equal whole prefixes:

    h[0] = xxh3_64( ROOT_SEED || extra_keys(model_id, cache_salt) || le_u32[] tokens[0:B] )
    h[i] = xxh3_64( le_u64(h[i-1]) || le_u32[] tokens[i*B:(i+1)*B] )

`extra_keys` (model id, cache salt, and later an adapter id) enter the FIRST block only, so two
tenants with different salts share no block at all, while within one tenant every block is still a
function of the whole prefix. Hashes are unsigned 64-bit ints (xxh3_64, stable across processes and
machines; never Python's `hash()`). Encoding: token ids as little-endian uint32, the parent as
little-endian uint64, extra keys as UTF-8 joined by 0x1F (unit separator) after a 0x1E record
separator.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from sys import byteorder

import xxhash

ROOT_SEED = b"aigw-kv-v1"
_SWAP = byteorder != "little"


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    data = array("I", token_ids)
    if _SWAP:
        data.byteswap()
    return data.tobytes()


def first_block_prefix(model_id: str, cache_salt: str | None,
                       adapter_id: str | None = None) -> bytes:
    """The bytes that stand in for the (absent) parent of block 0: seed plus the extra keys."""
    keys = [model_id, cache_salt or "", adapter_id or ""]
    return ROOT_SEED + b"\x1e" + "\x1f".join(keys).encode()


def hash_block(parent: bytes | int, token_ids: Sequence[int]) -> int:
    """Hash one full block. `parent` is the previous block's hash, or `first_block_prefix(...)`."""
    prefix = parent.to_bytes(8, "little") if isinstance(parent, int) else parent
    return xxhash.xxh3_64_intdigest(prefix + _token_bytes(token_ids))


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: str | None = None,
    *,
    parent_hashes: Sequence[int] = (),
    adapter_id: str | None = None,
) -> list[int]:
    """Hashes of every full block of `token_ids`.

    `parent_hashes` are hashes already known for the first blocks (they are returned as they are and
    the chain continues from the last one), so a growing request is hashed incrementally.
    """
    num_full_blocks = len(token_ids) // block_size
    hashes = list(parent_hashes[:num_full_blocks])
    parent: bytes | int = (hashes[-1] if hashes
                           else first_block_prefix(model_id, cache_salt, adapter_id))
    for block_index in range(len(hashes), num_full_blocks):
        start = block_index * block_size
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
