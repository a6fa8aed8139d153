"""Moving whole KV blocks between the device pool and the host tier's rows.

Design notes: docs/kv-cache.md."""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kvcache.key_bounds import KeyBounds
from jaxkv.kvcache.pages import PagedKVCache
from jaxkv.kvcache.pools import HNDPages, QuantizedPages

_UNIT_FIELDS = ("data", "scale", "zero", "sealed")   # the per-block arrays of a QuantizedPages


def _pool_units(p, ids: jax.Array) -> list[jax.Array]:
    if isinstance(p, HNDPages):
        return _pool_units(p.data, ids)
    if not isinstance(p, QuantizedPages):
        return [p[ids]]
    out = [getattr(p, f)[ids] for f in _UNIT_FIELDS if getattr(p, f) is not None]
    return [a.astype(jnp.uint8) if a.dtype == jnp.bool_ else a for a in out]


def block_units(cache: PagedKVCache, ids: jax.Array) -> list[jax.Array]:
    """The units of blocks ``ids`` (int32 [n]): one array [n, ...] per field, layer order."""
    out = []
    for k, v in zip(cache.k, cache.v):
        out += _pool_units(k, ids) + _pool_units(v, ids)
    for b in cache.bounds:
        out += [b.kmin[ids], b.kmax[ids]]
    return out


def _put_pool(p, ids: jax.Array, units: list[jax.Array]):
    if isinstance(p, HNDPages):
        return HNDPages(_put_pool(p.data, ids, units))
    if not isinstance(p, QuantizedPages):
        return p.at[ids].set(units.pop(0))
    new = {}
    for f in _UNIT_FIELDS:
        a = getattr(p, f)
        if a is not None:
            x = units.pop(0)
            new[f] = a.at[ids].set(x.astype(a.dtype))
    if p.res_slot is not None:   # read from the codes: no residual slot
        new["res_slot"] = p.res_slot.at[ids].set(0)
    return QuantizedPages(**{f: new.get(f, getattr(p, f)) for f in
                             ("data", "scale", "zero", "residual", "res_slot", "res_owner",
                              "res_stamp", "clock", "sealed")},
                          fmt=p.fmt, axis=p.axis, group_size=p.group_size,
                          residual_full_precision=p.residual_full_precision,
                          static_scale=p.static_scale, head_dim=p.head_dim,
                          residual_blocks=p.residual_blocks)


def put_block_units(cache: PagedKVCache, ids: jax.Array, units: Sequence[jax.Array]
                    ) -> PagedKVCache:
    """The cache with blocks ``ids`` (int32 [n], distinct but for the null block) set to
    ``units`` (as ``block_units`` returns them)."""
    units = list(units)
    k, v = [], []
    for kp, vp in zip(cache.k, cache.v):
        k.append(_put_pool(kp, ids, units))
        v.append(_put_pool(vp, ids, units))
    bounds = []
    for b in cache.bounds:
        kmin, kmax = units.pop(0), units.pop(0)
        bounds.append(KeyBounds(kmin=b.kmin.at[ids].set(kmin), kmax=b.kmax.at[ids].set(kmax)))
    return PagedKVCache(k=tuple(k), v=tuple(v), bounds=tuple(bounds))


_gather = jax.jit(block_units)
_scatter = jax.jit(put_block_units, donate_argnums=0)


def supports_swap(cache: PagedKVCache) -> bool:
    """Whether a sequence's blocks can be swapped out and back exactly: not for KIVI pools,
    whose unsealed blocks live in the per-sequence residual, which a unit does not carry."""
    return not any(isinstance(p, QuantizedPages) and p.residual is not None for p in cache.k)


TRANSFER_BUCKETS = (8, 64, 512)   # blocks per jitted transfer
STAGINGS = ("auto", "pinned_host", "none")


def _staging(staging: str, devices) -> str:
    """The staging ``staging`` resolves to on ``devices`` (see the module docstring)."""
    if staging not in STAGINGS:
        raise ValueError(f"staging={staging!r} is not one of {STAGINGS}")
    pinned = all("pinned_host" in {m.kind for m in d.addressable_memories()} for d in devices)
    if staging == "auto":
        return "pinned_host" if pinned and devices[0].platform != "cpu" else "none"
    if staging == "pinned_host" and not pinned:
        raise ValueError(f"staging='pinned_host': {devices[0].platform} devices have no "
                         f"pinned_host memory")
    return staging


def _batches(n: int):
    """``(start, stop, padded size)`` of the batches that move ``n`` blocks."""
    top = TRANSFER_BUCKETS[-1]
    for start in range(0, n, top):
        m = min(n - start, top)
        yield start, start + m, next(b for b in TRANSFER_BUCKETS if b >= m)


def _pad(ids: Sequence[int], size: int) -> np.ndarray:
    out = np.zeros(size, np.int32)   # padding: the null block
    out[:len(ids)] = ids
    return out


class HostKVPool:
    """The host tier's bytes (``rows``) and the batched copies between them and the pool.

    Args:
      cache: the device cache (its structure and sharding fix the unit layout).
      num_slots: host rows; or
      num_bytes: a budget: as many whole rows as fit (maybe 0).
      staging: ``"auto"``, ``"pinned_host"`` or ``"none"``: the buffers between the device and
        the rows (module docstring).

    Attributes:
      devices: the devices whose shards a row holds, in row order.
      fields: per unit field, ``(shape of one block, dtype, sharding, shape of one block's
        shard on a device)``.
      device_bytes, block_bytes: bytes of one block's shard on one device, and of a row.
      staging: what ``staging`` resolved to.
    """

    def __init__(self, cache: PagedKVCache, num_slots: int | None = None, *,
                 num_bytes: int | None = None, staging: str = "auto"):
        probe = _gather(cache, jnp.zeros(TRANSFER_BUCKETS[0], jnp.int32))
        self.devices = sorted({d for a in probe for d in a.sharding.addressable_devices},
                              key=lambda d: d.id)
        self._index = {d: i for i, d in enumerate(self.devices)}
        self.staging = _staging(staging, self.devices)
        kind = "pinned_host" if self.staging == "pinned_host" else None
        self.fields = [(a.shape[1:], np.dtype(a.dtype), a.sharding.with_memory_kind(kind)
                        if kind else a.sharding, a.sharding.shard_shape(a.shape)[1:])
                       for a in probe]
        self._part_sharding = {d: jax.sharding.SingleDeviceSharding(d, memory_kind=kind)
                               for d in self.devices}
        self._gather = (jax.jit(block_units, out_shardings=[f[2] for f in self.fields])
                        if kind else _gather)
        sizes = [int(np.prod(shard)) * dtype.itemsize for _, dtype, _, shard in self.fields]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        self.device_bytes = int(self.offsets[-1])
        self.block_bytes = len(self.devices) * self.device_bytes
        if num_slots is None:
            num_slots = num_bytes // self.block_bytes
        self.rows = np.zeros((num_slots, self.block_bytes), np.uint8)
        self._pending: list[tuple[np.ndarray, list[jax.Array]]] = []
        self.bytes_out = self.bytes_in = 0   # bytes copied each way so far

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def swap_out(self, cache: PagedKVCache, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Start copying device ``blocks`` into host ``slots`` (landed by ``finish``)."""
        for lo, hi, size in _batches(len(blocks)):
            units = self._gather(cache, jnp.asarray(_pad(blocks[lo:hi], size)))
            if self.staging == "none":   # pinned outputs are already bound for the host
                for a in units:
                    a.copy_to_host_async()
            self._pending.append((np.asarray(slots[lo:hi]), units))
        self.bytes_out += len(blocks) * self.block_bytes

    def pending_slots(self) -> set[int]:
        """Host slots whose copy from the device has not landed yet."""
        return {int(s) for slots, _ in self._pending for s in slots}

    def finish(self) -> None:
        """Land every started swap-out in its rows."""
        for slots, units in self._pending:
            n = len(slots)
            for lo, hi, a in zip(self.offsets[:-1], self.offsets[1:], units):
                for shard in a.addressable_shards:
                    base = self._index[shard.device] * self.device_bytes
                    host = np.ascontiguousarray(np.asarray(shard.data)[:n])
                    self.rows[slots, base + lo:base + hi] = host.reshape(n, -1).view(np.uint8)
        self._pending = []

    def write_rows(self, slots: Sequence[int], rows: Sequence[np.ndarray]) -> None:
        """Set host ``slots`` to ``rows`` (uint8 [block_bytes] each, e.g. read from disk)."""
        for slot, row in zip(slots, rows):
            self.rows[slot] = row

    def swap_in(self, cache: PagedKVCache, slots: Sequence[int], blocks: Sequence[int]
                ) -> PagedKVCache:
        """The cache (donated) with device ``blocks`` set from host ``slots`` (a slot whose
        swap-out is still in flight is landed first)."""
        if self.pending_slots() & {int(s) for s in slots}:
            self.finish()
        for lo, hi, size in _batches(len(blocks)):
            rows = np.asarray(slots[lo:hi])
            units = []
            for (shape, dtype, sharding, shard), a, b in zip(self.fields, self.offsets[:-1],
                                                             self.offsets[1:]):
                parts = []
                for d, device in enumerate(self.devices):   # one copy out of the rows each
                    part = np.zeros((size, b - a), np.uint8)
                    base = d * self.device_bytes
                    part[:hi - lo] = self.rows[rows, base + a:base + b]
                    parts.append(jax.device_put(part.view(dtype).reshape(size, *shard),
                                                self._part_sharding[device]))
                units.append(jax.make_array_from_single_device_arrays((size, *shape), sharding,
                                                                      parts))
            cache = _scatter(cache, jnp.asarray(_pad(blocks[lo:hi], size)), units)
        self.bytes_in += len(blocks) * self.block_bytes
        return cache

    def warmup(self, cache: PagedKVCache) -> PagedKVCache:
        """Compiles both transfers at every ``TRANSFER_BUCKETS`` size (null block onto itself,
        through no host row); returns the cache."""
        for size in TRANSFER_BUCKETS:
            ids = jnp.zeros(size, jnp.int32)
            units = self._gather(cache, ids)   # staged like a swap-in's parts
            cache = _scatter(cache, ids, units)
        return cache

    def measure(self, cache: PagedKVCache, num_blocks: int, repeats: int = 3
                ) -> tuple[PagedKVCache, float, float]:
        """Times synchronous copies of ``num_blocks`` blocks each way, ``repeats`` times after
        one that compiles, through host slot 0 onward, and writes every block back with its own
        content (call it on a cache without KIVI residual state, e.g. at start: a KIVI block
        comes back read from its codes). The host rows and byte counters are left as they were.

        Returns:
          (the cache, device-to-host bytes/s, host-to-device bytes/s), medians.
        """
        n = min(num_blocks, self.rows.shape[0], cache.num_blocks - 1)
        blocks, slots = list(range(1, n + 1)), list(range(n))
        saved, counters = self.rows[:n].copy(), (self.bytes_out, self.bytes_in)
        out, back = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            self.swap_out(cache, blocks, slots)
            self.finish()
            t1 = time.perf_counter()
            cache = jax.block_until_ready(self.swap_in(cache, slots, blocks))
            out.append(n * self.block_bytes / (t1 - t0))
            back.append(n * self.block_bytes / (time.perf_counter() - t1))
        self.rows[:n] = saved
        self.bytes_out, self.bytes_in = counters
        return cache, float(np.median(out[1:])), float(np.median(back[1:]))
