"""The user's engine arguments, one frozen dataclass per concern (``EngineConfig``'s groups;
the ``scheduler`` group is ``SchedulerConfig``, jaxkv/config/scheduler.py). Every field is an
``option``: checked at construction, a flat keyword of ``LLM(...)`` and a CLI flag."""

from __future__ import annotations

import dataclasses

from jaxkv.attention import ATTENTION_IMPLS
from jaxkv.config.kv_events import KVEventsConfig, parse_json
from jaxkv.config.options import check_fields, option, parse_bytes, parse_none
from jaxkv.config.scheduler import PREEMPTION_MODES, PREFIX_CACHING_MODES
from jaxkv.kvcache.spec import KV_ALIASES, KV_FORMATS, LAYOUTS, MODEL_DTYPES
from jaxkv.model.quantization import DEFAULT_GROUP, METHODS, check_group
from jaxkv.retention.streaming import POSITIONS

SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
RETENTION_MODES = ("full", "streaming", "h2o", "snapkv", "random")
OFFLOAD_POLICIES = ("lru",)
SPARSE_ATTENTION_METHODS = ("quest",)
QUANTIZATION_MODES = ("none", *METHODS)      # and None: as stored


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Which model the engine runs, and how."""

    model: str = option("SmolLM2-135M-Instruct", "store name, .gguf file, HF model directory "
                        "or orbax checkpoint")
    dtype: str = option("auto", "parameter, activation and default KV dtype (auto: bfloat16 on "
                        "GPU, float32 on CPU)", choices=("auto", *MODEL_DTYPES))
    seed: int = option(0, "engine seed of requests without their own")
    quantization: str | None = option(
        None, "weights: as stored (unset: a GGUF's dense Q8_0/Q4_0/Q4_1 weights stay in their "
        "blocks, Q4_K/Q6_K repacked bit-exact, products dequantize them in registers), none (dequantize every weight to "
        "dtype at load), or the dense projections and experts quantized at load: int8 or fp8 (e4m3) with "
        "a scale per output channel, int4 with a scale and minimum per group",
        choices=QUANTIZATION_MODES)
    quantization_group_size: int = option(
        DEFAULT_GROUP, "values per scale of quantization=int4 (a multiple of 32)", minimum=1)

    def __post_init__(self):
        check_fields(self)
        check_group(self.quantization_group_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheArgs:
    """The KV cache: its format, block size, pool size and prefix caching."""

    kv_cache_dtype: str = option("auto", "KV format (auto = the model dtype; formats and "
                                 "aliases: jaxkv/kvcache/spec.py)",
                                 choices=("auto", *KV_FORMATS, *KV_ALIASES))
    kv_layout: str = option("auto", "float KV pools' memory order: nhd [blocks, tokens, heads, "
                            "dim] or hnd [blocks, heads, tokens, dim] (auto: hnd for the CPU "
                            "paths, nhd for pallas and quantized formats)",
                            choices=("auto", *LAYOUTS))
    kv_residual_blocks: int = option(1, "int4/int2 (KIVI): residual window in blocks kept in "
                                     "full precision", minimum=1)
    kv_group_size: int | None = option(None, "int4/int2 (KIVI): channels per value scale/zero "
                                       "group (default: the largest divisor of head_dim <= 32)",
                                       minimum=1)
    block_size: int = option(16, "tokens per KV block", minimum=1)
    gpu_memory_utilization: float = option(
        0.9, "fraction of device memory the engine plans with (CPU: of half the available host "
        "memory, in steps of 1/16 of the total, and the pool at most 2 GiB or one "
        "max_model_len sequence: memory_plan.CPU_KV_CACHE_BYTES)",
        minimum=1e-3, maximum=1.0, aliases=("memory_utilization",),
        flags=("--memory-utilization",))
    kv_cache_memory_bytes: int | None = option(
        None, "KV pool size in bytes (e.g. 8GiB), instead of the utilization sizing (and of "
        "the CPU default, 2 GiB)", minimum=1,
        aliases=("kv_cache_bytes",), flags=("--kv-cache-memory",), parse=parse_bytes)
    num_gpu_blocks_override: int | None = option(
        None, "KV pool size in blocks (including the null block), instead of both", minimum=2,
        aliases=("num_kv_blocks",), flags=("--num-kv-blocks",))
    prefix_caching: str | None = option("hash", "prefix caching: hash (full blocks), radix "
                                        "(token granular) or none",
                                        choices=PREFIX_CACHING_MODES,
                                        parse=parse_none)
    hybrid_kv_cache: bool = option(
        True, "a model mixing sliding-window and full layers gives each kind its own block "
        "tables, the sliding ones keeping only their window (vLLM's hybrid KV cache manager); "
        "off: every layer keeps every block")

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetentionArgs:
    """KV retention: which blocks a sequence keeps (StreamingLLM, H2O, SnapKV, random)."""

    kv_retention: str = option("full", "which KV a sequence keeps: full, streaming "
                               "(attention sinks + a rolling window; blocks leaving the window "
                               "are freed, so a sequence may outgrow the model's context) or "
                               "h2o (heavy hitters by accumulated attention + a recent window, "
                               "in kv_budget_tokens), snapkv (the prompt compressed once, at the "
                               "end of prefill, to kv_budget_tokens by its last "
                               "kv_observation_tokens' attention) or random (h2o's budget, "
                               "random victims)", choices=RETENTION_MODES)
    kv_sink_tokens: int = option(4, "streaming, h2o, snapkv, random and quest: first positions "
                                 "every query attends to (attention sinks)", minimum=0)
    kv_budget_tokens: int | None = option(None, "h2o and random: KV tokens a sequence keeps "
                                          "(half recent window); snapkv: prompt KV tokens kept",
                                          minimum=1)
    kv_observation_tokens: int | None = option(None, "snapkv: the prompt's last tokens whose "
                                               "attention ranks its blocks (and that are "
                                               "kept); default 32", minimum=1)
    kv_window_tokens: int | None = option(None, "streaming: recent positions a query attends "
                                          "to, itself included", minimum=1)
    kv_positions: str = option("cache", "streaming: RoPE positions within the cache "
                               "(StreamingLLM) or the original positions",
                               choices=POSITIONS)

    def __post_init__(self):
        check_fields(self)
        if self.kv_retention == "streaming" and self.kv_window_tokens is None:
            raise ValueError("kv_retention='streaming' needs kv_window_tokens (the rolling "
                             "window, e.g. 1020 with kv_sink_tokens=4 for a 1024-token cache)")
        if self.kv_retention != "streaming" and self.kv_window_tokens is not None:
            raise ValueError(f"kv_window_tokens={self.kv_window_tokens} is used only with "
                             f"kv_retention='streaming'")
        budgeted = ("h2o", "snapkv", "random")
        if self.kv_retention in budgeted and self.kv_budget_tokens is None:
            raise ValueError(f"kv_retention={self.kv_retention!r} needs kv_budget_tokens (the "
                             f"KV tokens a sequence keeps, e.g. 20% of its length)")
        if self.kv_retention not in budgeted and self.kv_budget_tokens is not None:
            raise ValueError(f"kv_budget_tokens={self.kv_budget_tokens} is used only with "
                             f"kv_retention in {budgeted}")
        if self.kv_retention != "snapkv" and self.kv_observation_tokens is not None:
            raise ValueError(f"kv_observation_tokens={self.kv_observation_tokens} is used only "
                             f"with kv_retention='snapkv'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseAttentionArgs:
    """Sparse decode attention: Quest's query-aware page selection."""

    sparse_attention: str | None = option(
        None, "query-aware sparse decode attention: quest (each decode token attends to the "
        "pages whose per-channel key bounds score highest, plus the sinks and the recent "
        "window; prefill stays dense) or none", choices=SPARSE_ATTENTION_METHODS,
        parse=parse_none)
    sparse_budget_tokens: int | None = option(
        None, "quest: KV positions each decode token attends to, in whole blocks (rounded up), "
        "sinks and recent window included", minimum=1)
    sparse_recent_tokens: int = option(
        32, "quest: most recent positions every decode token attends to, itself included",
        minimum=1)

    def __post_init__(self):
        check_fields(self)
        if self.sparse_attention == "quest" and self.sparse_budget_tokens is None:
            raise ValueError("sparse_attention='quest' needs sparse_budget_tokens (the KV "
                             "positions each decode token attends to, e.g. 512)")
        if self.sparse_attention is None and self.sparse_budget_tokens is not None:
            raise ValueError(f"sparse_budget_tokens={self.sparse_budget_tokens} is used only "
                             f"with sparse_attention='quest'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadArgs:
    """KV offload: the host tier, the persistent cache behind it, and preemption."""

    kv_offload_bytes: int | None = option(
        None, "host KV tier size in bytes (e.g. 8GiB): evicted prefix-cache blocks are demoted "
        "to it and promoted back on a hit, and preempted sequences may be swapped to it",
        minimum=1, aliases=("kv_offload_size",), flags=("--kv-offload-size",),
        parse=parse_bytes)
    kv_offload_policy: str = option("lru", "host tier eviction order", choices=OFFLOAD_POLICIES)
    kv_cache_dir: str | None = option(
        None, "directory of a persistent prefix cache: host-tier blocks are written there "
        "(content-addressed) and a restarted engine hits them; needs kv_offload_bytes")
    preemption_mode: str = option(
        "auto", "how a preempted sequence comes back: recompute, swap (its blocks to the host "
        "tier and back) or auto (per request, whichever the measured copy bandwidth and "
        "prefill rate say is faster; recompute without a host tier)", choices=PREEMPTION_MODES)


    def __post_init__(self):
        check_fields(self)
        if self.kv_cache_dir is not None and self.kv_offload_bytes is None:
            raise ValueError(f"kv_cache_dir={self.kv_cache_dir!r} needs kv_offload_bytes (the "
                             f"host tier the persistent cache is written from)")
        if self.preemption_mode == "swap" and self.kv_offload_bytes is None:
            raise ValueError("preemption_mode='swap' needs kv_offload_bytes (the host tier "
                             "preempted sequences are swapped to)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelArgs:
    """How the model is split over devices."""

    tensor_parallel_size: int = option(1, "devices the model is split over", minimum=1,
                                       flags=("-tp",))
    data_parallel_size: int = option(1, "independent replicas, each over tensor_parallel_size "
                                     "devices (jaxkv.DataParallelLLM)", minimum=1, flags=("-dp",))
    mesh: object = option(None, "an explicit jax.sharding.Mesh {'dp': 1, 'tp': N}", cli=False)

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeArgs:
    """How the device step runs and compiles."""

    attention_impl: str | None = option(None, "attention implementation (default: pallas on "
                                        "GPU, grouped on CPU)", choices=ATTENTION_IMPLS)
    interpret: bool = option(False, "run Pallas kernels in interpret mode (CPU)")
    warmup: bool = option(False, "compile every (tokens, sequences) bucket at start")
    compilation_cache: bool = option(True, "use JAX's persistent compilation cache")
    compilation_cache_dir: str | None = option(None, "its directory (default: under the user "
                                               "cache dir, or $JAXKV_COMPILATION_CACHE_DIR)")

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeArgs:
    """Speculative decoding: the draft proposer and how many tokens it drafts (vLLM's names)."""

    speculative: str | None = option(
        None, "draft proposer: ngram (prompt lookup in the request's own prompt + output), "
        "suffix (lookup in every request's prompt + output, running or recent: SuffixDecoding), "
        "draft (a small model with the same tokenizer: speculative_model) or none",
        choices=SPECULATIVE_METHODS, parse=parse_none)
    speculative_model: str | None = option(
        None, "draft: the draft model (store name, .gguf file, HF model directory or orbax "
        "checkpoint, loaded like model), with the target's vocabulary")
    num_speculative_tokens: int = option(4, "most draft tokens a sequence carries per step",
                                         minimum=1)
    prompt_lookup_max: int = option(4, "ngram: longest suffix of the tokens looked up",
                                    minimum=1)
    prompt_lookup_min: int = option(1, "ngram: shortest suffix of the tokens looked up",
                                    minimum=1)
    suffix_max_depth: int = option(16, "suffix: longest substring counted (the longest suffix "
                                   "matched is one shorter)", minimum=2)
    suffix_cache_tokens: int = option(16384, "suffix: most tokens of requests no longer running "
                                      "kept indexed (oldest out)", minimum=0)
    suffix_min_probability: float = option(
        0.1, "suffix: drafting stops where the draft's estimated probability (the product of its "
        "tokens' observed continuation frequencies) falls below this", minimum=0.0, maximum=1.0)
    speculative_adaptive: bool = option(
        True, "choose each step's draft lengths (0 included) from the measured acceptance, the "
        "measured step time by padded shape and (draft) the draft's measured forwards")

    def __post_init__(self):
        check_fields(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.speculative == "draft" and not self.speculative_model:
            raise ValueError('speculative="draft" needs speculative_model (the draft model: '
                             'a small model with the target\'s tokenizer)')

    @property
    def max_drafts(self) -> int:
        """Draft tokens a sequence may carry: ``num_speculative_tokens``, 0 when off."""
        return self.num_speculative_tokens if self.speculative else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVEventsArgs:
    """KV-cache events for KV-aware routers (Dynamo, llm-d), in vLLM's wire format."""

    kv_events_config: KVEventsConfig | None = option(
        None, "publish the prefix cache's block stores and removals over ZMQ: a dict (CLI: "
        "JSON) of vLLM's KVEventsConfig fields (enable_kv_cache_events, publisher, endpoint, "
        "replay_endpoint, buffer_steps, hwm, max_queue_size, topic) and encoding (array or "
        "map)", parse=parse_json)

    def __post_init__(self):
        check_fields(self)
        object.__setattr__(self, "kv_events_config", KVEventsConfig.of(self.kv_events_config))

    @property
    def enabled(self) -> bool:
        """Whether the engine records and publishes KV-cache events."""
        return self.kv_events_config is not None and self.kv_events_config.enabled
