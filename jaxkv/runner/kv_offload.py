"""The device side of the host KV tier: ``KVOffload`` applies a plan's block transfers between
the device pool and host memory (``HostKVPool``) and writes demoted prefix blocks to the
persistent cache (``DiskKVStore``). The engine builds it over the runner's pool and attaches it
(``ModelRunner.attach_offload``); the host tier's bookkeeping is jaxkv/blocks/host_tier.py."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from jaxkv.config import OffloadArgs
from jaxkv.config.kv_groups import KVGroups
from jaxkv.kvcache import disk_store
from jaxkv.kvcache.host_pool import HostKVPool
from jaxkv.kvcache.pages import PagedKVCache
from jaxkv.kvcache.spec import KVCacheSpec
from jaxkv.model.config import ModelConfig
from jaxkv.sched.plan import StepPlan

logger = logging.getLogger(__name__)


class KVOffload:
    """A host pool of block units, the persistent cache behind it (or None), and the swap-outs
    whose demoted prefix blocks go to disk once they land.

    Attributes:
      pool: the host tier's bytes and batched copies (jaxkv/kvcache/host_pool.py).
      disk: the persistent prefix cache (``kv_cache_dir``; jaxkv/kvcache/disk_store.py), or None.
      copy_bandwidth: (device-to-host, host-to-device) bytes/s of block transfers measured at
        start.
    """

    def __init__(self, pool: HostKVPool, disk: disk_store.DiskKVStore | None,
                 copy_bandwidth: tuple[float, float]):
        self.pool, self.disk = pool, disk
        self.copy_bandwidth = copy_bandwidth
        self._to_disk: list[tuple[int, int]] = []   # (slot, key) landing, then written to disk

    @property
    def num_slots(self) -> int:
        """Blocks the host tier holds."""
        return self.pool.rows.shape[0]

    @classmethod
    def build(cls, cache: PagedKVCache, spec: KVCacheSpec, cc: OffloadArgs, *, model_path: Path,
              model_config: ModelConfig, tensor_parallel_size: int,
              kv_groups: KVGroups = KVGroups()) -> tuple[KVOffload, PagedKVCache]:
        """The host tier of ``cc.kv_offload_bytes`` over ``cache`` (as many whole block units as
        fit), its copy bandwidth measured, and the persistent cache behind it
        (``cc.kv_cache_dir``, namespaced by everything that shapes a block's bytes: a hybrid
        cache's ``kv_groups`` too, which place the layers in a unit's slots). Returns it and
        the pool, which the measurement donated."""
        if cc.preemption_mode == "swap" and spec.format.kivi:
            raise ValueError(f"preemption_mode='swap' cannot swap {spec.kv_cache_dtype} (KIVI) "
                             f"pools: their unsealed blocks live in the per-sequence residual; "
                             f"use preemption_mode='auto' or 'recompute'")
        pool = HostKVPool(cache, num_bytes=cc.kv_offload_bytes)
        slots = pool.rows.shape[0]
        if slots < 1:
            raise ValueError(f"kv_offload_bytes={cc.kv_offload_bytes} holds no block: one "
                             f"all-layer block is {pool.block_bytes} bytes")
        cache, d2h, h2d = pool.measure(cache, 64)
        logger.info("host KV tier: %d blocks of %d bytes (%.2f GiB), staging %s; copies "
                    "%.2f GB/s out, %.2f GB/s in", slots, pool.block_bytes,
                    slots * pool.block_bytes / 2**30, pool.staging, d2h / 1e9, h2d / 1e9)
        disk = None
        if cc.kv_cache_dir is not None:
            ns = disk_store.namespace(
                model=disk_store.model_identity(model_path), config=repr(model_config),
                kv_cache_dtype=spec.kv_cache_dtype, dtype=spec.dtype, block_size=spec.block_size,
                num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, group_size=spec.group_size,
                key_bounds=spec.key_bounds, layout=spec.layout,
                tensor_parallel_size=tensor_parallel_size,
                unit=repr([(f[0], f[1], f[3]) for f in pool.fields]),
                devices=len(pool.devices),
                **({"kv_groups": repr(kv_groups)} if kv_groups.hybrid else {}))
            disk = disk_store.DiskKVStore(cc.kv_cache_dir, ns, pool.block_bytes)
        return cls(pool, disk, (d2h, h2d)), cache

    def transfer(self, cache: PagedKVCache, plan: StepPlan) -> PagedKVCache:
        """Applies a plan's transfers (in jaxkv/blocks/host_tier.py's order): the previous
        plan's swap-outs land (and its demoted prefix blocks go to disk), this plan's swap-outs
        start (asynchronous: they overlap this step), its disk rows fill their host slots, and
        its swap-ins write their device blocks. Returns the pool."""
        self._land()
        self._to_disk = [(slot, key) for _, slot, key in plan.swap_out if key is not None]
        self.pool.swap_out(cache, [b for b, _, _ in plan.swap_out],
                           [slot for _, slot, _ in plan.swap_out])
        self.pool.write_rows([slot for slot, _ in plan.disk_loads],
                             [row for _, row in plan.disk_loads])
        return self.pool.swap_in(cache, [slot for slot, _ in plan.swap_in],
                                 [b for _, b in plan.swap_in])

    def flush(self, cache: PagedKVCache, cached: Sequence[tuple[int, int]] = ()) -> None:
        """Lands in-flight swap-outs and writes the demoted blocks still pending to disk; with
        a persistent cache also the ``(key, block)`` device blocks ``cached`` (the device
        prefix cache at close), in batches through host slot 0 onward."""
        pool = self.pool
        self._land()
        if self.disk is None:
            return
        todo = [(k, b) for k, b in cached if k not in self.disk]
        n = pool.rows.shape[0]
        saved = pool.rows[:min(n, len(todo))].copy()
        for i in range(0, len(todo), n):
            batch = todo[i:i + n]
            pool.swap_out(cache, [b for _, b in batch], list(range(len(batch))))
            pool.finish()
            for slot, (key, _) in enumerate(batch):
                self.disk.store(key, pool.rows[slot])
        pool.rows[:len(saved)] = saved

    def _land(self) -> None:
        """Lands the swap-outs in flight, and writes the demoted prefix blocks among them to
        the persistent cache."""
        self.pool.finish()
        if self.disk is not None:
            for slot, key in self._to_disk:
                self.disk.store(key, self.pool.rows[slot])
        self._to_disk = []
