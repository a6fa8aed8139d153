"""The engine arguments resolved against the model and the backend: the defaults that depend on
them (dtype, attention implementation, KV format and layout, KIVI group, ``max_model_len``) and
Quest's static options, checked against the model and the parallel layout."""

from __future__ import annotations

import dataclasses

import jax

from jaxkv.attention.options import QuestOptions
from jaxkv.attention.quest import min_budget
from jaxkv.config.engine import EngineConfig
from jaxkv.kvcache.spec import KV_FORMATS, default_group_size, resolve_kv_cache_dtype
from jaxkv.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The engine arguments whose defaults depend on the backend or the model.

    Attributes:
      dtype: parameter / activation dtype name (``"auto"``: bfloat16 on GPU, float32 on CPU).
      attention_impl: ``"pallas"`` on GPU, ``"grouped"`` on CPU unless chosen (the
        reference's results to float rounding, 2-5x faster there: bench/experiments/attention_cpu.py).
      kv_cache_dtype: the canonical KV format name.
      kv_layout: the pools' layout (``KVCacheSpec.layout``): ``"hnd"`` for a float format read
        by the CPU paths (its gathered blocks need no transpose: bench/experiments/kv_layout.py), else
        ``"nhd"`` unless chosen.
      kv_group_size: KIVI's value group (default: the largest divisor of head_dim <= 32).
      max_model_len: default ``min(model context, 8192)``.
    """

    dtype: str
    attention_impl: str
    kv_cache_dtype: str
    kv_layout: str
    kv_group_size: int
    max_model_len: int


def resolve(config: EngineConfig, model_config: ModelConfig) -> Resolved:
    """The backend- and model-dependent defaults of ``config`` for ``model_config``."""
    on_gpu = jax.default_backend() == "gpu"
    dtype = config.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu else "float32"
    impl = config.runtime.attention_impl or ("pallas" if on_gpu else "grouped")
    kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype)
    layout = config.cache.kv_layout
    if layout == "auto":
        layout = "nhd" if impl == "pallas" or KV_FORMATS[kv_cache_dtype].quantized else "hnd"
    return Resolved(
        dtype=dtype, attention_impl=impl, kv_cache_dtype=kv_cache_dtype, kv_layout=layout,
        kv_group_size=config.cache.kv_group_size or default_group_size(model_config.head_dim),
        max_model_len=(config.scheduler.max_model_len
                       or min(model_config.max_position_embeddings, 8192)))


def quest_options(config: EngineConfig, model_config: ModelConfig, max_blocks_per_seq: int,
                  kivi: bool) -> QuestOptions | None:
    """The static Quest options of ``config`` (None when ``sparse_attention`` is off): the
    budget in whole blocks, capped at ``max_blocks_per_seq`` (a sequence's whole table: every
    live page), with ``kv_sink_tokens`` sinks and ``sparse_recent_tokens`` recent positions.

    Raises:
      ValueError: naming the field, for a budget below the pages the sinks, the recent window
        and the KIVI residual window force, under tensor parallelism, or for a model with its
        own sliding window.
    """
    cc, sp, ret = config.cache, config.sparse, config.retention
    if sp.sparse_attention is None:
        return None
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError(f"sparse_attention={sp.sparse_attention!r} runs on one device; "
                         f"tensor_parallel_size={config.parallel.tensor_parallel_size} is not "
                         f"supported with it yet")
    if model_config.sliding_window is not None:
        raise ValueError(f"sparse_attention={sp.sparse_attention!r}: the model attends through "
                         f"its own sliding_window={model_config.sliding_window}, which the "
                         f"sparse selection does not know")
    bs = cc.block_size
    need = min_budget(bs, num_sinks=ret.kv_sink_tokens, recent=sp.sparse_recent_tokens,
                      residual_blocks=cc.kv_residual_blocks if kivi else 1)
    budget = -(-sp.sparse_budget_tokens // bs)
    if budget < need:
        raise ValueError(f"sparse_budget_tokens={sp.sparse_budget_tokens} ({budget} blocks of "
                         f"{bs}) must cover the {need} blocks that kv_sink_tokens="
                         f"{ret.kv_sink_tokens}, sparse_recent_tokens={sp.sparse_recent_tokens}"
                         + (f" and kv_residual_blocks={cc.kv_residual_blocks}" if kivi else "")
                         + " may force")
    return QuestOptions(budget=max(need, min(budget, max_blocks_per_seq)),
                        num_sinks=ret.kv_sink_tokens, recent=sp.sparse_recent_tokens)
