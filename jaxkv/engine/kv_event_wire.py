"""vLLM's KV-cache event wire format (``vllm/distributed/kv_events.py``): msgspec structs
encoded as msgpack. A batch is the array ``[ts, [event, ...], data_parallel_rank]``; each event
is tagged with its class name, in one of two encodings:

    "array"  a tagged array of the fields vLLM had while its events were ``array_like``, the
             form llm-d's indexer decodes (exactly 8, 3 and 1 elements):
               ["BlockStored", [hash, ...], parent | nil, [token, ...], block_size, lora_id,
                medium, lora_name]
               ["BlockRemoved", [hash, ...], medium]          ["AllBlocksCleared"]
    "map"    a tagged map of vLLM 0.32-0.34's fields, those at their defaults left out:
               {"type": "BlockStored", "block_hashes": [...], ..., "extra_keys": [...],
                "group_idx": g}

Dynamo reads both. The array form has no ``extra_keys`` or ``group_idx`` (llm-d would refuse the
longer arrays), so the tracker publishes only a hybrid cache's group 0 in it.
"""

from __future__ import annotations

from typing import Any

import msgspec

MASK64 = (1 << 64) - 1


def external_hash(key) -> int:
    """A prefix key as vLLM publishes a block hash (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
    its default): the last 8 bytes, big-endian, of the key's 64-bit two's complement, an
    unsigned int."""
    return int(key) & MASK64


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _array_classes() -> tuple[type, type, type]:
    """vLLM's events as tagged arrays, with the fields of its ``array_like`` releases."""

    class KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


def _map_classes() -> tuple[type, type, type]:
    """vLLM's events as tagged maps: 0.32's fields, order, defaults and tags (0.34 adds
    ``lookahead_token_ids``, never set here: left out, the bytes are 0.32's)."""

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return BlockStored, BlockRemoved, AllBlocksCleared


_CLASSES = {"array": _array_classes(), "map": _map_classes()}


class Wire:
    """Events and batches of one ``encoding`` (``"array"`` or ``"map"``)."""

    def __init__(self, encoding: str):
        self.encoding = encoding
        self._stored, self._removed, self._cleared = _CLASSES[encoding]
        self._encoder = msgspec.msgpack.Encoder()

    def stored(self, hashes: list[int], parent: int | None, tokens: list[int], block_size: int,
               medium: str, extra_keys: list | None, group: int | None):
        """A BlockStored (``extra_keys``: one entry per block; it and ``group``: map only)."""
        fields = (hashes, parent, tokens, block_size, None, medium, None)
        if self.encoding == "array":
            return self._stored(*fields)
        return self._stored(*fields, extra_keys, group)

    def removed(self, hashes: list[int], medium: str, group: int | None):
        """A BlockRemoved (``group``: map only)."""
        if self.encoding == "array":
            return self._removed(hashes, medium)
        return self._removed(hashes, medium, group)

    def cleared(self):
        return self._cleared()

    def encode(self, ts: float, events: list, data_parallel_rank: int) -> bytes:
        """One batch's msgpack payload."""
        return self._encoder.encode(EventBatch(ts, events, data_parallel_rank))
