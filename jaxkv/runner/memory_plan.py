"""Memory planner: how many KV blocks fit on a device, and plain-language advice when they do not.

Design notes: docs/runtime.md."""

from __future__ import annotations

import dataclasses
import functools
import math
import os

from jaxkv.config.kv_groups import KVGroups, window_blocks
from jaxkv.kvcache.spec import (KV_FORMATS, LATENT_FORMATS, KVCacheSpec, check_model_dtype,
                                get_format, kivi_residual_slots, resolve_kv_cache_dtype)
from jaxkv.model.config import ModelConfig

GiB = 1 << 30

# Bytes per parameter of each weight dtype (the model dtypes of the KV-format registry).
WEIGHT_DTYPES = {f.storage: f.bits // 8 for f in KV_FORMATS.values() if not f.quantized}


def _advice_formats() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The per-token KV formats the OOM advice offers: the first registry format of each size
    with its same-size alternatives (bf16 with fp16, fp8_e4m3 with fp8_e5m2 and int8)."""
    sizes: dict[tuple[int, int], list[str]] = {}
    for f in KV_FORMATS.values():
        if not f.kivi:
            sizes.setdefault((f.bits, f.metadata_bytes), []).append(f.name)
    return tuple((names[0], tuple(names[1:])) for names in sizes.values())


_ADVICE_KV = _advice_formats()

# The reference attention walks kv in chunks of ~256 positions and gathers K/V per query token.
ATTENTION_KV_CHUNK_TOKENS = 256
# f32 [S, V] copies the sampler keeps live: logits, log-softmax, sorted values, probabilities,
# Gumbel noise and the penalty counts.
SAMPLER_VOCAB_COPIES = 6
# Tensor-parallel degrees the advice tries.
_TP_DEGREES = (2, 4, 8)
# Highest memory_utilization the advice suggests (the rest is for the runtime and fragmentation).
_MAX_SUGGESTED_UTILIZATION = 0.95
# The KV pool's default size on the CPU, where host memory is shared with everything else (vLLM's
# CPU build: VLLM_CPU_KVCACHE_SPACE, 4 GiB): 2 GiB holds 45k tokens of SmolLM2-135M in float32,
# more than a CPU computes for at once; the engine raises it to one max_model_len sequence.
CPU_KV_CACHE_BYTES = 2 * GiB


def kv_bytes_per_vector(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one token's K (or V) vector of one kv head: packed elements plus metadata.

    ``ceil(head_dim x bits / 8) + metadata_bytes`` (``KVFormat.vector_bytes``); ``kv_dtype`` is
    a ``KV_FORMATS`` name or alias (not ``"auto"``).
    """
    return get_format(kv_dtype).vector_bytes(head_dim)


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str, tensor_parallel_size: int = 1) -> int:
    """KV bytes one token occupies over all layers on one device: ``2 x L x Hkv x kv_bytes_per_vector``
    (an MLA model: ``L x kv_bytes_per_vector(Lkv + R)``, its one latent head and no V).

    Args:
      config: the model; its ``num_kv_heads`` (not ``num_heads``) counts, so GQA is accounted.
      kv_dtype: a ``KV_FORMATS`` name or alias (not ``"auto"``).
      tensor_parallel_size: devices the kv heads are split over; each holds
        ``max(Hkv, tp) / tp`` heads (kv heads are repeated when fewer than devices).
    """
    heads = max(config.num_kv_heads, tensor_parallel_size) // tensor_parallel_size
    vectors = 1 if config.mla else 2          # MLA: one latent vector, no V
    return vectors * config.num_layers * heads * kv_bytes_per_vector(kv_dtype, config.head_dim)


def kv_groups(config: ModelConfig, hybrid_kv_cache: bool = True) -> KVGroups:
    """The KV cache's layer groups: the model's (``ModelConfig.kv_groups``), or with
    ``hybrid_kv_cache=False`` one full-attention group of every layer (vLLM's
    ``disable_hybrid_kv_cache_manager``)."""
    return KVGroups.of_model(config) if hybrid_kv_cache else KVGroups()


def device_kv_spec(config: ModelConfig, kv_dtype: str, block_size: int,
                   tensor_parallel_size: int = 1, group_size: int | None = None, *,
                   dtype: str = "float32", num_residual_slots: int | None = None,
                   key_bounds: bool = False, hybrid_kv_cache: bool = True) -> KVCacheSpec:
    """The ``KVCacheSpec`` of one device's share of the cache, for its per-block and residual
    byte counts: one layer per pool slot (``KVGroups.num_slots``: ``num_layers`` unless the
    cache is hybrid), ``max(Hkv, tp) / tp`` kv heads (repeated when fewer than devices) and
    the smallest pool (2 blocks; a block's bytes do not depend on the pool size).

    Raises:
      ValueError: naming the field, for a geometry the format cannot serve.
    """
    heads = max(config.num_kv_heads, tensor_parallel_size) // tensor_parallel_size
    slots = kv_groups(config, hybrid_kv_cache).num_slots(config.num_layers)
    return KVCacheSpec(num_layers=slots, num_blocks=2, block_size=block_size,
                       num_kv_heads=heads, head_dim=config.head_dim, dtype=dtype,
                       kv_cache_dtype=kv_dtype, group_size=group_size,
                       num_residual_slots=num_residual_slots, key_bounds=key_bounds,
                       v_head_dim=config.kv_cache_v_dim)


def kv_bytes_per_block(config: ModelConfig, kv_dtype: str, block_size: int,
                       tensor_parallel_size: int = 1, group_size: int | None = None, *,
                       key_bounds: bool = False, hybrid_kv_cache: bool = True) -> int:
    """Exact KV bytes of one block over all pool slots (K and V) on one device
    (``KVCacheSpec.block_bytes``): one slot per layer, or a hybrid cache's ``num_slots``
    (every block id owns a page in every slot; ``hybrid_kv_cache=False``: every layer).

    Float, fp8, int8: ``block_size x kv_bytes_per_token``. KIVI int4/int2 per layer and kv head:
    keys ``bs x ceil(D bits / 8) + 2 x 2 D`` (bf16 scale and zero per channel), values
    ``bs x (ceil(D bits / 8) + 2 x 2 D / G)`` (per token, G = ``group_size``, default
    ``default_group_size(D)``), plus per layer ``2 x 5`` bytes of residual-slot index and sealed
    flag (K and V pools). ``key_bounds`` (Quest) adds ``2 x 4 D`` bytes per layer and kv head
    for a float, fp8 or int8 format (f32 kmin and kmax per channel).
    """
    spec = device_kv_spec(config, kv_dtype, block_size, tensor_parallel_size, group_size,
                          key_bounds=key_bounds, hybrid_kv_cache=hybrid_kv_cache)
    return spec.block_bytes


def kivi_residual_bytes(config: ModelConfig, kv_dtype: str, dtype: str, block_size: int,
                        num_slots: int, tensor_parallel_size: int = 1, *,
                        hybrid_kv_cache: bool = True) -> int:
    """Bytes of the KIVI full-precision residual pool (0 for other KV dtypes;
    ``KVCacheSpec.residual_bytes``).

    Per layer (a hybrid cache: per pool slot, see ``device_kv_spec``) and pool (K, V):
    ``(num_slots + 1)`` slots (slot 0 is null) of ``block_size x Hkv x D`` elements in the
    weight ``dtype`` plus an int32 owner and stamp each, and an int32 clock.
    """
    kv = resolve_kv_cache_dtype(kv_dtype, dtype)
    if not KV_FORMATS[kv].kivi:
        return 0
    spec = device_kv_spec(config, kv, block_size, tensor_parallel_size, dtype=dtype,
                          num_residual_slots=num_slots, hybrid_kv_cache=hybrid_kv_cache)
    return spec.residual_bytes


def num_parameters(config: ModelConfig) -> int:
    """Exact parameter count: the elements of every tensor of the model's checkpoint
    (``weights.expected_shapes``: the embedding, each layer's attention, dense MLP or router
    and experts, norms and biases, the LM head unless tied to the embedding)."""
    return _device_elements(config, 1)


def weights_bytes(config: ModelConfig, dtype: str = "float32", tensor_parallel_size: int = 1) -> int:
    """Bytes of the parameters one device stores in ``dtype`` (one of ``WEIGHT_DTYPES``): under
    tensor parallelism each tensor's share on a device (``device_shares.device_tensor_shapes``:
    k/v heads repeated up to the degree; norms, routers and an MLA model's latent
    down-projections whole; the rest split)."""
    check_model_dtype(dtype)
    return _device_elements(config, tensor_parallel_size) * WEIGHT_DTYPES[dtype]


@functools.lru_cache(maxsize=64)
def _device_elements(config: ModelConfig, tensor_parallel_size: int) -> int:
    """Elements of the checkpoint's tensors one of ``tensor_parallel_size`` devices holds
    (cached: a plan's levers ask for them hundreds of times, and DeepSeek-V3 names 47K
    tensors)."""
    from jaxkv.runner.device_shares import device_tensor_shapes
    shapes = device_tensor_shapes(config, tensor_parallel_size)
    return sum(math.prod(s) for s in shapes.values())


def activation_bytes_estimate(config: ModelConfig, *, dtype: str = "float32",
                              kv_cache_dtype: str = "auto", max_num_batched_tokens: int = 2048,
                              max_num_seqs: int = 256) -> int:
    """Peak workspace of one step, an upper-bound estimate.

    ``T x [(2E + (2Hq + 2Hkv) D + 3F) x b + C x (2 Hkv x kv_bytes_per_vector + 2 Hq x 4)]
    + S x V x 4 x SAMPLER_VOCAB_COPIES`` with ``T = max_num_batched_tokens``, ``S =
    min(max_num_seqs, T)`` sampled rows, ``b`` the weight dtype's bytes and ``C =
    ATTENTION_KV_CHUNK_TOKENS``. The terms: one layer's activations (residual and normed input,
    q/k/v, attention output, SwiGLU gate/up/product; layers run one at a time), the reference
    attention's per-token K/V gather and f32 scores/probabilities of one kv chunk (a Pallas kernel
    needs far less), and the sampler's f32 ``[S, V]`` arrays.
    """
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    E, F, D = config.hidden_size, config.intermediate_size, config.head_dim
    Hq, Hkv = config.num_heads, config.num_kv_heads
    layer = (2 * E + (2 * Hq + 2 * Hkv) * D + 3 * F) * WEIGHT_DTYPES[dtype]
    attention = ATTENTION_KV_CHUNK_TOKENS * (2 * Hkv * kv_bytes_per_vector(kv_dtype, D) + 2 * Hq * 4)
    sampled_rows = min(max_num_seqs, max_num_batched_tokens)
    return (max_num_batched_tokens * (layer + attention)
            + sampled_rows * config.vocab_size * 4 * SAMPLER_VOCAB_COPIES)


def host_memory_budget(fraction: float = 0.5) -> int:
    """Bytes the CPU backend may plan with: ``fraction`` of the host's available memory, rounded
    down to a multiple of 1/16 of its total memory (unless that leaves nothing).

    Reads ``MemTotal`` and ``MemAvailable`` from ``/proc/meminfo`` (Linux), else
    ``psutil.virtual_memory()``. Half by default: XLA's CPU client keeps host copies of inputs
    and temporaries, and the Python process, the tokenizer and other programs share the same
    memory. The rounding keeps the pool it sizes, and with it the shape of every compiled step,
    the same from one start to the next while free memory drifts by less than a step: a pool
    sized by the exact free memory made each start miss the persistent compilation cache and
    compile every step again.

    Raises:
      ValueError: ``fraction`` outside (0, 1].
      RuntimeError: neither source is available.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    total, available = _host_memory()
    budget, step = int(available * fraction), total // 16
    return budget // step * step or budget


def _host_memory() -> tuple[int, int]:
    """(total, available) host memory in bytes (see ``host_memory_budget``)."""
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in          # the values are in kB
                    (line.split(":", 1) for line in f if ":" in line)
                    if k in ("MemTotal", "MemAvailable")}
        if len(info) == 2:
            return info["MemTotal"], info["MemAvailable"]
    try:
        import psutil
    except ImportError:
        raise RuntimeError("host memory unknown: no MemAvailable in /proc/meminfo and no psutil"
                           ) from None
    memory = psutil.virtual_memory()
    return memory.total, memory.available


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"``; binary units up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One layer group of the KV cache in a plan (sizes per device).

    Attributes:
      window: the group's sliding window W, or None (full attention).
      num_layers: its layers.
      kv_bytes_per_token: one token's K and V over its layers, ``2 x layers x Hkv x
        kv_bytes_per_vector``, paid while the token is inside the group's window.
      blocks_per_seq: blocks one ``max_model_len`` sequence holds in its table at once.
    """

    window: int | None
    num_layers: int
    kv_bytes_per_token: int
    blocks_per_seq: int

    @property
    def kind(self) -> str:
        """``"full"`` or ``"sliding W"``."""
        return "full" if self.window is None else f"sliding {self.window}"


def group_plans(config: ModelConfig, groups: KVGroups, kv_dtype: str, *, max_model_len: int,
                max_num_batched_tokens: int, block_size: int, tensor_parallel_size: int = 1,
                retained_blocks_per_seq: int | None = None) -> tuple[GroupPlan, ...]:
    """Each group's ``GroupPlan``: a full group holds ``cdiv(L, block_size)`` blocks of an
    ``L``-token sequence, a sliding one ``window_blocks`` (or, one group only, the retention
    policy's ``retained_blocks_per_seq``)."""
    heads = max(config.num_kv_heads, tensor_parallel_size) // tensor_parallel_size
    per_layer = ((1 if config.mla else 2) * heads           # B/token/layer (MLA: no V)
                 * kv_bytes_per_vector(kv_dtype, config.head_dim))
    layers = groups.layers or (tuple(range(config.num_layers)),)
    return tuple(GroupPlan(
        w, len(members), len(members) * per_layer,
        retained_blocks_per_seq if retained_blocks_per_seq is not None
        else window_blocks(w, max_model_len, max_num_batched_tokens, block_size))
        for w, members in zip(groups.windows, layers))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Result of ``plan``: the memory split and the KV pool geometry.

    Attributes:
      dtype, kv_cache_dtype: weight dtype and resolved KV dtype names.
      block_size, max_model_len, max_num_seqs, max_num_batched_tokens: the planned limits.
      device_memory_bytes, memory_utilization: the inputs; ``budget_bytes`` is their product.
      weights_bytes, activation_bytes: weights and step workspace (estimate or given).
      kv_budget_bytes: bytes available for the KV pool (``budget - weights - activations``, or
        the explicit ``kv_cache_bytes`` / ``num_kv_blocks`` size).
      kv_cache_bytes: the pool actually planned, ``num_blocks x kv_bytes_per_block``.
      kv_bytes_per_token, kv_bytes_per_block: KV footprint of one token / one block (a hybrid
        cache: of one block id, a page in each of its pool slots).
      num_blocks: blocks in the pool *including* the reserved null block 0.
      max_num_tokens: tokens the usable blocks hold, ``(num_blocks - 1) x block_size``.
      max_concurrent_seqs: sequences of ``max_model_len`` tokens that fit at once.
      runs: the engine can start (weights, activations and one full-length sequence fit).
      fits: ``runs`` and all ``max_num_seqs`` full-length sequences fit at once.
      reasons: when not ``fits``, what is short and which levers would fit, in plain language.
      tensor_parallel_size: devices the model is split over; every size above is per device.
      kv_head_replication: devices holding each kv head (> 1 when kv heads < devices: repeated).
      kv_residual_bytes: the KIVI full-precision residual pool (int4/int2; ``max_num_seqs + 1``
        slots), else 0.
      retained_blocks_per_seq: a KV retention policy's bound on the blocks one sequence holds
        (StreamingLLM: sinks + window + one step), or None (a sequence holds all its blocks).
      kv_source: what sized the pool, in words (the engine's ``plan_memory`` says), or "".
      groups: per layer group of the KV cache (one unless the cache is hybrid), its kind,
        layers, bytes per token and blocks per sequence; empty: one full group.
      weights_format: what the weights are when not all in ``dtype`` (a GGUF's blocks kept),
        in words; "": all in ``dtype``.
    """

    dtype: str
    kv_cache_dtype: str
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    device_memory_bytes: int
    memory_utilization: float
    budget_bytes: int
    weights_bytes: int
    activation_bytes: int
    kv_budget_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    num_blocks: int
    max_num_tokens: int
    max_concurrent_seqs: int
    runs: bool
    fits: bool
    reasons: tuple[str, ...]
    tensor_parallel_size: int = 1
    kv_head_replication: int = 1
    kv_residual_bytes: int = 0
    retained_blocks_per_seq: int | None = None
    kv_source: str = ""
    groups: tuple[GroupPlan, ...] = ()
    weights_format: str = ""

    @property
    def hybrid(self) -> bool:
        """Whether groups of different kinds share the pool (some give blocks back)."""
        return len(self.groups) > 1

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can own: all but the null block 0."""
        return max(self.num_blocks - 1, 0)

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one sequence of ``max_model_len`` tokens holds at once: over its groups'
        tables (a hybrid cache), or its retention policy's bound when one is given."""
        if self.groups:
            return sum(g.blocks_per_seq for g in self.groups)
        if self.retained_blocks_per_seq is not None:
            return self.retained_blocks_per_seq
        return -(-self.max_model_len // self.block_size)

    def headline(self) -> str:
        """The pool in one line: blocks, tokens, bytes and what sized it."""
        return (f"KV pool: {self.num_usable_blocks:,} blocks x {self.block_size} tokens = "
                f"{self.max_num_tokens:,} tokens, {format_bytes(self.kv_cache_bytes)} "
                f"{self.kv_cache_dtype}" + (f" ({self.kv_source})" if self.kv_source else "")
                + f"; weights {format_bytes(self.weights_bytes)} "
                + (self.weights_format or self.dtype))

    def summary(self) -> str:
        """A readable table of the plan, its verdict and the reasons."""
        used = self.weights_bytes + self.activation_bytes + self.kv_cache_bytes
        rows = [
            ("device memory", format_bytes(self.device_memory_bytes)),
            ("tensor parallel (sizes per device)", f"{self.tensor_parallel_size}"),
            ("kv heads replicated on", f"{self.kv_head_replication} device(s) each"),
            (f"budget (x {self.memory_utilization:g})", format_bytes(self.budget_bytes)),
            (f"weights ({self.weights_format or self.dtype})", format_bytes(self.weights_bytes)),
            ("activations / workspace", format_bytes(self.activation_bytes)),
            (f"KV cache ({self.kv_cache_dtype})", format_bytes(self.kv_cache_bytes)),
            ("KIVI residual pool", format_bytes(self.kv_residual_bytes)),
            ("left in budget", format_bytes(self.budget_bytes - used)),
            ("KV bytes per token" + (f" ({max(g.num_layers for g in self.groups)} pool slots)"
                                     if self.hybrid else ""), f"{self.kv_bytes_per_token:,} B"),
            (f"KV bytes per block ({self.block_size} tokens)", f"{self.kv_bytes_per_block:,} B"),
            *self._group_rows(),
            ("blocks (incl. null block 0)", f"{self.num_blocks:,}"),
            ("tokens in cache", f"{self.max_num_tokens:,}"),
            (f"sequences of {self.max_model_len:,} tokens at once",
             f"{self.max_concurrent_seqs:,} (max_num_seqs {self.max_num_seqs:,})"),
            ("runs / fits", f"{'yes' if self.runs else 'no'} / {'yes' if self.fits else 'no'}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["jaxkv memory plan"] + [f"  {k:<{width}}  {v:>16}" for k, v in rows]
        lines += [f"  KV pool: {self.kv_source}"] if self.kv_source else []
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)

    def _group_rows(self) -> list[tuple[str, str]]:
        """``summary``'s rows of a hybrid cache: one per group, then the blocks per sequence."""
        if not self.hybrid:
            return []
        return [(f"group {i}: {g.kind}, {g.num_layers} layers",
                 f"{g.kv_bytes_per_token:,} B/token, {g.blocks_per_seq:,} blocks/seq")
                for i, g in enumerate(self.groups)] + [
            (f"blocks per {self.max_model_len:,}-token sequence", f"{self.blocks_per_seq:,}")]


def plan(config: ModelConfig | str | os.PathLike, *, device_memory_bytes: int,
         memory_utilization: float = 0.9,
         dtype: str = "float32", kv_cache_dtype: str = "auto", block_size: int = 16,
         max_model_len: int | None = None, max_num_seqs: int = 256,
         max_num_batched_tokens: int = 2048, activation_bytes: int | None = None,
         kv_cache_bytes: int | None = None, num_kv_blocks: int | None = None,
         tensor_parallel_size: int = 1, kv_residual_blocks: int = 1,
         kv_group_size: int | None = None,
         retained_blocks_per_seq: int | None = None, key_bounds: bool = False,
         hybrid_kv_cache: bool = True, stored_weights_bytes: int | None = None,
         weights_format: str = "") -> MemoryPlan:
    """Sizes the paged KV pool and says whether the configuration fits.

    All sizes are per device: with ``tensor_parallel_size`` t > 1 each device holds its share
    of the weights and of every KV block (its kv heads), and every device holds the same
    ``num_blocks``; activations are counted whole (conservative).

    Args:
      config: the model: a ModelConfig, or a GGUF file, HF directory, ``config.json`` or store
        name whose hyper-parameters are read (no weights are loaded).
      device_memory_bytes: memory of one device (GPU HBM, or ``host_memory_budget()`` on CPU).
      memory_utilization: fraction of it the engine may use, in (0, 1].
      dtype: weight dtype, one of ``WEIGHT_DTYPES``.
      kv_cache_dtype: ``"auto"`` (= ``dtype``) or a ``KV_FORMATS`` name or alias.
      block_size: tokens per KV block.
      max_model_len: longest sequence; default the model's ``max_position_embeddings``.
      max_num_seqs: most sequences running at once.
      max_num_batched_tokens: token budget of one step (sizes the activation estimate).
      activation_bytes: workspace to reserve instead of ``activation_bytes_estimate``.
      kv_cache_bytes: KV pool size instead of the utilization sizing.
      num_kv_blocks: pool size in blocks (including the null block) instead of the utilization
        sizing; exclusive with ``kv_cache_bytes``.
      tensor_parallel_size: devices the model is split over (see jaxkv.runner.sharding).
      kv_residual_blocks: KIVI residual window in blocks (int4/int2): the full-precision
        residual pool holds ``kivi_residual_slots(max_num_seqs, kv_residual_blocks)`` blocks.
      kv_group_size: KIVI value group (channels per bf16 scale and zero, int4/int2); None:
        ``default_group_size(head_dim)``, the largest divisor of head_dim up to 32.
      retained_blocks_per_seq: the most blocks one sequence holds under a KV retention policy
        (``jaxkv.retention``); then ``max_model_len`` may exceed the model's context.
      key_bounds: Quest sparse attention keeps per-block key bounds beside the K pools (counted
        in every block's bytes; none for KIVI formats).
      hybrid_kv_cache: a model whose layers mix attention kinds keeps one block table per layer
        group (``ModelConfig.kv_groups``) over ``num_slots`` pool slots, its sliding groups
        only their window's blocks; False: every layer caches every token (vLLM's
        ``disable_hybrid_kv_cache_manager``). No effect on a model with one attention kind.
      stored_weights_bytes: the weights' bytes as the engine holds them (a GGUF's quantized
        blocks kept: ``jaxkv.model.weights.stored_weights_bytes``), instead of
        ``weights_bytes(config, dtype)``; ``weights_format`` says what they are, in words.

    Returns:
      MemoryPlan; check ``runs`` before starting an engine and ``fits`` for preemption-free load.
      Each lever in ``reasons`` is computed by re-planning with only that argument changed.

    Raises:
      ValueError: naming the invalid argument.
    """
    if not isinstance(config, ModelConfig):
        from jaxkv.model.weights import load_config  # file formats only when given a path

        config = load_config(config)
    kw = dict(device_memory_bytes=device_memory_bytes, memory_utilization=memory_utilization,
              dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, activation_bytes=activation_bytes,
              kv_cache_bytes=kv_cache_bytes, num_kv_blocks=num_kv_blocks,
              tensor_parallel_size=tensor_parallel_size, kv_residual_blocks=kv_residual_blocks,
              kv_group_size=kv_group_size, retained_blocks_per_seq=retained_blocks_per_seq,
              key_bounds=key_bounds, hybrid_kv_cache=hybrid_kv_cache,
              stored_weights_bytes=stored_weights_bytes, weights_format=weights_format)
    p = _size(config, **kw)
    return p if p.fits else dataclasses.replace(p, reasons=tuple(_reasons(config, p, kw)))


def _size(config: ModelConfig, *, device_memory_bytes, memory_utilization, dtype, kv_cache_dtype,
          block_size, max_model_len, max_num_seqs, max_num_batched_tokens, activation_bytes,
          kv_cache_bytes, num_kv_blocks, tensor_parallel_size=1,
          kv_residual_blocks=1, kv_group_size=None, retained_blocks_per_seq=None,
          key_bounds=False, hybrid_kv_cache=True, stored_weights_bytes=None,
          weights_format="") -> MemoryPlan:
    """``plan`` without the reasons: validation and the arithmetic."""
    _check_sizes(device_memory_bytes, memory_utilization, tensor_parallel_size)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    if max_model_len is None:
        max_model_len = config.max_position_embeddings
    _check_limits(config, block_size=block_size, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens,
                  kv_residual_blocks=kv_residual_blocks, kv_group_size=kv_group_size,
                  max_model_len=max_model_len, retained_blocks_per_seq=retained_blocks_per_seq,
                  activation_bytes=activation_bytes, kv_cache_bytes=kv_cache_bytes,
                  num_kv_blocks=num_kv_blocks)
    groups = kv_groups(config, hybrid_kv_cache)
    if groups.hybrid and retained_blocks_per_seq is not None:
        raise ValueError(f"retained_blocks_per_seq={retained_blocks_per_seq}: a KV retention "
                         f"policy cannot run on a hybrid KV cache (the layers mix attention "
                         f"kinds); plan with hybrid_kv_cache=False")

    budget = int(device_memory_bytes * memory_utilization)
    weights = (weights_bytes(config, dtype, tensor_parallel_size) if stored_weights_bytes is None
               else stored_weights_bytes)
    if activation_bytes is None:
        activation_bytes = activation_bytes_estimate(
            config, dtype=dtype, kv_cache_dtype=kv_dtype,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    per_block = kv_bytes_per_block(config, kv_dtype, block_size, tensor_parallel_size,
                                   kv_group_size, key_bounds=key_bounds,
                                   hybrid_kv_cache=hybrid_kv_cache)
    residual = kivi_residual_bytes(config, kv_dtype, dtype, block_size,
                                   kivi_residual_slots(max_num_seqs, kv_residual_blocks,
                                                       kv_groups(config, hybrid_kv_cache)
                                                       .num_groups),
                                   tensor_parallel_size, hybrid_kv_cache=hybrid_kv_cache)
    if num_kv_blocks is not None:
        kv_budget = num_kv_blocks * per_block
    elif kv_cache_bytes is not None:
        kv_budget = kv_cache_bytes
    else:
        kv_budget = max(budget - weights - activation_bytes - residual, 0)
    num_blocks = kv_budget // per_block
    usable = max(num_blocks - 1, 0)
    plans = group_plans(config, groups, kv_dtype, max_model_len=max_model_len,
                        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                        tensor_parallel_size=tensor_parallel_size,
                        retained_blocks_per_seq=retained_blocks_per_seq)
    blocks_per_seq = sum(g.blocks_per_seq for g in plans)       # over every group's table
    in_budget = weights + activation_bytes + residual + num_blocks * per_block <= budget
    runs = in_budget and usable >= blocks_per_seq
    return MemoryPlan(
        dtype=dtype, kv_cache_dtype=kv_dtype, block_size=block_size, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        device_memory_bytes=device_memory_bytes, memory_utilization=memory_utilization,
        budget_bytes=budget, weights_bytes=weights, activation_bytes=activation_bytes,
        kv_budget_bytes=kv_budget, kv_cache_bytes=num_blocks * per_block,
        kv_bytes_per_token=-(-per_block // block_size), kv_bytes_per_block=per_block,
        num_blocks=num_blocks, max_num_tokens=usable * block_size,
        max_concurrent_seqs=usable // blocks_per_seq,
        runs=runs, fits=runs and usable >= max_num_seqs * blocks_per_seq, reasons=(),
        tensor_parallel_size=tensor_parallel_size,
        kv_head_replication=max(tensor_parallel_size // config.num_kv_heads, 1),
        kv_residual_bytes=residual, retained_blocks_per_seq=retained_blocks_per_seq,
        groups=plans, weights_format=weights_format)


def _check_sizes(device_memory_bytes, memory_utilization, tensor_parallel_size) -> None:
    """Raises ValueError, naming the argument, for a device size ``plan`` cannot use."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1")
    if device_memory_bytes <= 0:
        raise ValueError(f"device_memory_bytes={device_memory_bytes} must be > 0")
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization={memory_utilization} must be in (0, 1]")


def _check_limits(config: ModelConfig, *, block_size, max_num_seqs, max_num_batched_tokens,
                  kv_residual_blocks, kv_group_size, max_model_len, retained_blocks_per_seq,
                  activation_bytes, kv_cache_bytes, num_kv_blocks) -> None:
    """Raises ValueError, naming the argument, for a limit or pool size ``plan`` cannot use."""
    for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("kv_residual_blocks", kv_residual_blocks),
                        ("kv_group_size", 1 if kv_group_size is None else kv_group_size)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if retained_blocks_per_seq is None and not 1 <= max_model_len <= config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} must be in [1, the model's "
                         f"max_position_embeddings={config.max_position_embeddings}] (beyond "
                         f"it only with a retention policy, e.g. kv_retention='streaming')")
    if retained_blocks_per_seq is not None and retained_blocks_per_seq < 1:
        raise ValueError(f"retained_blocks_per_seq={retained_blocks_per_seq} must be >= 1")
    if activation_bytes is not None and activation_bytes < 0:
        raise ValueError(f"activation_bytes={activation_bytes} must be >= 0")
    if kv_cache_bytes is not None and num_kv_blocks is not None:
        raise ValueError("kv_cache_bytes and num_kv_blocks are exclusive; give one")
    if kv_cache_bytes is not None and kv_cache_bytes < 0:
        raise ValueError(f"kv_cache_bytes={kv_cache_bytes} must be >= 0")
    if num_kv_blocks is not None and num_kv_blocks < 2:
        raise ValueError(f"num_kv_blocks={num_kv_blocks} must be >= 2 (block 0 is the null block)")


def _largest(lo: int, hi: int, ok) -> int | None:
    """Largest ``x`` in ``[lo, hi]`` with ``ok(x)``, for ``ok`` true up to some point; or None."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _reasons(config: ModelConfig, p: MemoryPlan, kw: dict) -> list[str]:
    """The OOM checklist for a plan that does not fit: what is short, then each lever's value.

    The goal is ``runs`` when the engine cannot start, else ``fits``; a lever is listed with the
    most lenient value that reaches the goal, found by re-planning with that one argument changed.
    """
    goal = "fits" if p.runs else "runs"

    def ok(**change) -> bool:
        return getattr(_size(config, **{**kw, **change}), goal)

    fixed = p.weights_bytes + p.activation_bytes
    seqs = p.max_num_seqs if p.runs else 1
    need_blocks = seqs * p.blocks_per_seq + 1
    if fixed > p.budget_bytes:
        out = [f"weights {format_bytes(p.weights_bytes)} ({p.weights_format or p.dtype}) + "
               f"activations {format_bytes(p.activation_bytes)} exceed the budget "
               f"{format_bytes(p.budget_bytes)} ({p.memory_utilization:g} x "
               f"{format_bytes(p.device_memory_bytes)}) before any KV"]
    elif fixed + p.kv_cache_bytes > p.budget_bytes:
        out = [f"weights {format_bytes(p.weights_bytes)} + activations "
               f"{format_bytes(p.activation_bytes)} + the requested KV pool "
               f"{format_bytes(p.kv_cache_bytes)} exceed the budget "
               f"{format_bytes(p.budget_bytes)}; a KV pool of at most "
               f"{format_bytes(p.budget_bytes - fixed)} fits"]
    else:
        out = [f"needs {format_bytes(need_blocks * p.kv_bytes_per_block)} of KV for {seqs:,} x "
               f"{p.max_model_len:,} tokens ({need_blocks:,} blocks of {p.block_size} incl. the "
               f"null block), has {format_bytes(p.kv_budget_bytes)} ({p.num_blocks:,} blocks, "
               f"{p.max_concurrent_seqs:,} full-length sequences)"]
    longest = _largest(1, p.max_model_len - 1, lambda n: ok(max_model_len=n))
    if longest:
        out.append(f"lower max_model_len: max_model_len <= {longest:,} would fit")
    most = _largest(1, p.max_num_seqs - 1, lambda n: ok(max_num_seqs=n))
    if most:
        out.append(f"lower max_num_seqs: max_num_seqs <= {most:,} would fit"
                   + (" (or keep it and let the scheduler preempt under load)" if p.runs else ""))
    for q, alternatives in _ADVICE_KV:
        if config.mla:                  # a latent cache: floats and fp8 only
            if q not in LATENT_FORMATS:
                continue
            alternatives = tuple(a for a in alternatives if a in LATENT_FORMATS)
        q_plan = _size(config, **{**kw, "kv_cache_dtype": q})
        if q_plan.kv_bytes_per_block < p.kv_bytes_per_block:     # same slots and key bounds
            if fixed > p.budget_bytes and not getattr(q_plan, goal):
                continue    # KV is not what is short
            also = f" (or {', '.join(map(repr, alternatives))})" if alternatives else ""
            verdict = "would fit" if getattr(q_plan, goal) else "is not enough"
            out.append(f"quantize the KV cache: kv_cache_dtype={q!r}{also} holds "
                       f"{q_plan.max_concurrent_seqs:,} full-length sequences, {verdict}")
    if p.dtype == "float32" and not p.weights_format:
        verdict = "would fit" if ok(dtype="bfloat16") else "is not enough"
        out.append(f"use dtype='bfloat16': weights become "
                   f"{format_bytes(weights_bytes(config, 'bfloat16'))}, {verdict}")
    if not p.weights_format and p.tensor_parallel_size == 1:
        out.append(_quantize_reason(config, p, ok))
    tokens = _largest(1, p.max_num_batched_tokens - 1, lambda n: ok(max_num_batched_tokens=n))
    if tokens and kw["activation_bytes"] is None:
        out.append(f"lower max_num_batched_tokens: <= {tokens:,} shrinks the activation "
                   f"estimate enough to fit")
    hundredths = range(math.floor(p.memory_utilization * 100) + 1,
                       round(_MAX_SUGGESTED_UTILIZATION * 100) + 1)
    u = next((h / 100 for h in hundredths if ok(memory_utilization=h / 100)), None)
    if u is not None:
        out.append(f"raise memory_utilization: {u:.2f} would fit, if nothing else uses the device")
    out.append(_tp_reason(config, p, need_blocks))
    return out


def _quantize_reason(config: ModelConfig, p: MemoryPlan, ok) -> str:
    """The weights quantized at load (``quantization=``, jaxkv/model/quantize.py; int4 in
    groups of 128): the mildest method that reaches the goal, else the smallest one's bytes."""
    from jaxkv.model import quantize
    from jaxkv.model.weights import expected_shapes

    shapes, options = expected_shapes(config), {}        # stored bytes -> methods
    for method in quantize.METHODS:
        options.setdefault(quantize.stored_bytes(shapes, method, quantize.DEFAULT_GROUP,
                                                 WEIGHT_DTYPES[p.dtype]), []).append(method)
    for stored, methods in sorted(options.items(), reverse=True):
        fits = ok(stored_weights_bytes=stored, weights_format=methods[0])
        if fits or stored == min(options):
            also = f" (or {', '.join(map(repr, methods[1:]))})" if methods[1:] else ""
            return (f"quantize the weights: quantization={methods[0]!r}{also} holds the "
                    f"{quantize.what(config)} in {format_bytes(stored)} of weights, "
                    f"{'would fit' if fits else 'is not enough'}")


def _tp_reason(config: ModelConfig, p: MemoryPlan, need_blocks: int) -> str:
    """Smallest tensor-parallel degree whose per-device share fits ``need_blocks``.

    Per device: weights / t and KV / t (kv heads split); activations counted whole (conservative).
    """
    degrees = [t for t in _TP_DEGREES if config.num_kv_heads % t == 0]
    if not degrees:
        return (f"tensor parallelism cannot split num_kv_heads={config.num_kv_heads} over "
                f"{', '.join(map(str, _TP_DEGREES))} devices; use a larger device")
    for t in degrees:
        free = p.budget_bytes - p.weights_bytes / t - p.activation_bytes
        if free >= need_blocks * p.kv_bytes_per_block / t:
            return (f"add tensor parallelism: {t} devices like this one would fit "
                    f"(~{format_bytes(p.weights_bytes / t)} of weights and "
                    f"{format_bytes(need_blocks * p.kv_bytes_per_block / t)} of KV each)")
    return (f"tensor parallelism up to {degrees[-1]} devices is not enough; use larger "
            f"devices or a smaller model")
