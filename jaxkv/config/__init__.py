"""Engine configuration: frozen dataclasses validated at construction, each field declared once.

``EngineConfig`` groups what a user chooses, one dataclass per concern (jaxkv/config/args.py)::

    EngineConfig
      model        ModelArgs            which weights, dtype, engine seed
      cache        CacheArgs            KV format, block size, pool sizing, prefix caching
      retention    RetentionArgs        which KV a sequence keeps (streaming, H2O, SnapKV, ...)
      sparse       SparseAttentionArgs  Quest's sparse decode attention
      offload      OffloadArgs          host tier, persistent cache, preemption mode
      scheduler    SchedulerConfig      step limits, policy, buckets (max_model_len resolved later)
      parallel     ParallelArgs         tensor / data parallel sizes, an explicit mesh
      runtime      RuntimeArgs          attention implementation, warm-up, compilation cache
      speculative  SpeculativeArgs      speculative decoding: proposer, draft length
      kv_events    KVEventsArgs         KV-cache events for routers (kv_events.py)

The flat keyword arguments of ``LLM(...)`` (vLLM's names, plus aliases) and the CLI flags are
made from these fields (engine.py, options.py); a bad value raises naming the field before the
engine starts. ``CacheConfig`` and ``SchedulerConfig`` are what the host side reads once
resolved (scheduler.py); the step-shape arithmetic is shapes.py, the user-value checks
checks.py, and the defaults that depend on the model or the backend resolve.py.
"""

from jaxkv.config.args import (CacheArgs, KVEventsArgs, ModelArgs, OffloadArgs, ParallelArgs,
                               RetentionArgs, RuntimeArgs, SparseAttentionArgs, SpeculativeArgs)
from jaxkv.config.engine import EngineConfig, describe_arguments
from jaxkv.config.kv_events import KVEventsConfig
from jaxkv.config.scheduler import CacheConfig, SchedulerConfig

__all__ = ["CacheArgs", "CacheConfig", "EngineConfig", "KVEventsArgs", "KVEventsConfig",
           "ModelArgs", "OffloadArgs", "ParallelArgs", "RetentionArgs", "RuntimeArgs",
           "SchedulerConfig", "SparseAttentionArgs", "SpeculativeArgs", "describe_arguments"]
