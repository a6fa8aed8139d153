"""Absorbed multi-head latent attention (MLA) decode on GPU over the paged latent pool, split-K
(flash-decoding), Pallas (Triton lowering).

A program scores ``block_h`` query heads of one sequence against each latent tile it loads (MQA:
the tile ``[c_kv | k_rope]`` is the keys, its first Lkv channels the values) over its share of
the sequence's kept tiles; the splits' partial outputs merge by their lse. An fp8 latent pool
(``QuantizedPages``: e4m3/e5m2 codes with one scale per token, or a static scale) is dequantized
in the kernel, tile by tile, in chunks of ``DEQUANT_CHUNK`` channels. The spec is
``jaxkv.attention.mla.mla_attention_reference``; design notes: docs/attention.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.attention.pallas.decode import (default_num_splits, merge_splits, pad_rows,
                                           split_k_outputs)
from jaxkv.attention.pallas.kv_format import (DEQUANT_CHUNK, KvLayout, check_head_dim,
                                              check_offsets, load_chunk)
from jaxkv.attention.pallas.kv_walk import (finalize, init_carry, kv_walk, softmax_tile,
                                            split_steps, tile_scores)
from jaxkv.attention.pallas.ragged import (SUPPORTED_DTYPES, check_page_ids, check_seq_lens,
                                           check_tuning, is_concrete, kept_operands,
                                           whole_block)
from jaxkv.kvcache.pools import QuantizedPages
from jaxkv.kvcache.spec import LATENT_FORMATS


@dataclasses.dataclass(frozen=True)
class MLADecodeConfig:
    """Tuning of the MLA decode kernel (static; one compilation per distinct value).

    Attributes:
      block_h: query heads per program, the rows of its dots (power of two >= 16; the heads
        are padded to a multiple of it).
      block_kv: latent positions per kv tile (power of two >= 16).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the kv loop.
    """

    block_h: int = 16
    block_kv: int = 32
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        check_tuning(self, ("block_h", "block_kv", "num_warps"))
        if self.block_h < 16:
            raise ValueError(f"block_h={self.block_h} must be >= 16 (Triton dot minimum)")


def latent_layout(kv_lora_rank: int, rope_dim: int, *, scaled: bool = False,
                  static_scale: float | None = None) -> KvLayout:
    """The latent's chunks: a float pool's two, ``c_kv`` [0, Lkv) and ``k_rope`` [Lkv, Lkv + R)
    (Triton's block shapes are powers of two; ``Lkv + R`` = 576 is not); an fp8 pool's (per-token
    ``scaled`` or a ``static_scale``) each cut into ``DEQUANT_CHUNK``-channel chunks, the
    width the other kernels dequantize (kv_format.py; V3: 8 chunks of c_kv, 1 of k_rope).

    Raises:
      ValueError: unless Lkv and R are powers of two >= 16.
    """
    for name, dim in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", rope_dim)):
        try:
            check_head_dim(dim)
        except ValueError:
            raise ValueError(f"{name}={dim}: the Pallas MLA kernel needs a power of two >= 16 "
                             f"(Triton block shapes)") from None
    codes = scaled or static_scale is not None
    chunks = tuple((ch0, w, 0, 0) for start, dim in ((0, kv_lora_rank), (kv_lora_rank, rope_dim))
                   for w in [min(dim, DEQUANT_CHUNK) if codes else dim]
                   for ch0 in range(start, start + dim, w))
    return KvLayout(head_dim=kv_lora_rank + rope_dim, chunks=chunks, scaled=scaled,
                    static_scale=static_scale)


def value_chunks(layout: KvLayout, kv_lora_rank: int) -> KvLayout:
    """The chunks of ``layout`` that are values: c_kv's, [0, Lkv)."""
    return KvLayout(head_dim=kv_lora_rank,
                    chunks=tuple(c for c in layout.chunks if c[0] < kv_lora_rank))


def _mla_kernel(
    q_ref,       # [block_h, Lkv + R] a head tile of one sequence's token
    tables_ref,  # int32 [S, max_blocks]
    lens_ref,    # int32 [S]
    order_ref,   # int32 [S, max_blocks] kept_blocks' order
    kept_ref,    # int32 [S, max_blocks + 1] kept_blocks' kept_before
    *refs,       # inputs: the whole latent pool [num_blocks, block_size, 1, Lkv + R] (floats
                 #   or fp8 codes) [, bf16 per-token scales [num_blocks, block_size, 1, 1]];
                 #   outputs: o f32 [block_h, Lkv] normalized partial output of this split, lse
                 #   f32 [block_h] (-inf if the split saw nothing)
    num_splits: int, block_kv: int, sm_scale: float, layout: KvLayout, values: KvLayout):
    *pool_refs, o_ref, lse_ref = refs
    seq, split = pl.program_id(0), pl.program_id(2)
    num_blocks, block_size = pool_refs[0].shape[:2]
    kv_len = lens_ref[seq]
    tile_at, _, count = kv_walk(seq, kv_len - 1, kv_len, (order_ref, kept_ref),
                                block_kv=block_kv, block_size=block_size,
                                max_blocks=tables_ref.shape[1], sliding_window=None, num_sinks=0)
    v_start, v_stop = split_steps(count, split, num_splits)
    q = tuple(q_ref[:, pl.ds(ch0, width)] for ch0, width, _, _ in layout.chunks)  # [bh, w] each
    n_values = len(values.chunks)                         # c_kv's chunks come first

    def body(v, carry):
        logical, kv_pos, in_run = tile_at(v)                                     # [block_kv]
        page = jnp.clip(tables_ref[seq, logical], 0, num_blocks - 1)
        slot = lax.rem(kv_pos, block_size)
        latent = [load_chunk(pool_refs, layout, "token", chunk, page, slot, 0, q[0].dtype)
                  for chunk in layout.chunks]                                    # [bkv, w] each
        seen = ((kv_pos < kv_len) & in_run)[None, :]                             # [1, block_kv]
        return softmax_tile(carry, tile_scores(q, latent, sm_scale), seen,
                            latent[:n_values], soft_cap=None)

    carry = lax.fori_loop(v_start, v_stop, body, init_carry(q[0].shape[0], values))
    out, lse = finalize(carry)
    for (ch0, width, _, _), o in zip(values.chunks, out):
        o_ref[:, pl.ds(ch0, width)] = o
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=(
    "num_splits", "sm_scale", "interpret", "config", "layout", "kv_lora_rank"))
def _mla_call(q, pool_ops, block_tables, seq_lens, *, num_splits, sm_scale, interpret, config,
              layout, kv_lora_rank):
    S, N, D = q.shape
    Lkv, bh = kv_lora_rank, config.block_h
    Hb = -(-N // bh)                                                 # head tiles
    q4 = jnp.pad(q, ((0, 0), (0, Hb * bh - N), (0, 0))).reshape(S, Hb, bh, D)
    kept = kept_operands(block_tables, None)
    kernel = functools.partial(_mla_kernel, num_splits=num_splits, block_kv=config.block_kv,
                               sm_scale=sm_scale, layout=layout,
                               values=value_chunks(layout, Lkv))
    outs, lses = pl.pallas_call(
        kernel,
        grid=(S, Hb, num_splits),
        in_specs=[pl.BlockSpec((None, None, bh, D), lambda s, h, j: (s, h, 0, 0))]
        + [whole_block(a.shape) for a in (block_tables, seq_lens, *kept, *pool_ops)],
        **split_k_outputs(num_splits, S, Hb, bh, Lkv),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="jaxkv_mla_decode_attention",
    )(q4, block_tables, seq_lens, *kept, *pool_ops)
    # the head tiles as merge_splits' kv heads of groups of bh rows, the padding heads dropped
    out, lse = merge_splits(outs, lses, bh, jax.ShapeDtypeStruct((S, Hb * bh, Lkv), q.dtype))
    return out[:, :N], lse[:, :N]


def latent_operands(pool) -> tuple[tuple[jax.Array, ...], dict]:
    """The kernel operands of a latent pool and its ``latent_layout`` options: a float NHD
    array is one operand; an fp8 ``QuantizedPages`` (``LATENT_FORMATS``) its codes and bf16
    per-token scales [num_blocks, block_size, 1, 1] (the codes alone with a static scale).

    Raises:
      ValueError: for any other pool (HNDPages, int8/KIVI pools, more than one head), and for
        code pools ``check_offsets`` refuses.
    """
    if isinstance(pool, QuantizedPages) and pool.fmt in LATENT_FORMATS and pool.shape[2] == 1 \
            and (pool.scale is None or pool.scale.shape[-1] == 1):
        ops = (pool.data,) if pool.scale is None else (pool.data, pool.scale)
        check_offsets(ops)
        return ops, dict(scaled=pool.scale is not None, static_scale=pool.static_scale)
    if isinstance(pool, jax.Array) and pool.ndim == 4 and pool.shape[2] == 1:
        return (pool,), {}
    raise ValueError(f"the latent pool must be one NHD array [num_blocks, block_size, 1, Lkv + R] "
                     f"(a float latent cache) or fp8 QuantizedPages of one head "
                     f"({', '.join(f for f in LATENT_FORMATS)}), got {type(pool).__name__} "
                     f"{getattr(pool, 'fmt', '')}{getattr(pool, 'shape', '')}")


def _check_inputs(q, pool, block_tables, seq_lens, kv_lora_rank: int):
    """(kernel operands, latent layout) of valid inputs; ValueError naming what is wrong
    otherwise."""
    ops, options = latent_operands(pool)
    if q.ndim != 3 or q.shape[2] != pool.shape[3] or q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q must be [S, N, Lkv + R] = [{block_tables.shape[0]}, N, "
                         f"{pool.shape[3]}], got {q.shape}")
    if q.dtype not in SUPPORTED_DTYPES or (not options and q.dtype != pool.dtype):
        raise ValueError(f"q must be one of float32, bfloat16, float16, and a float latent pool "
                         f"share it, got {q.dtype} and {ops[0].dtype}")
    if block_tables.dtype != jnp.int32 or seq_lens.shape != (block_tables.shape[0],) \
            or seq_lens.dtype != jnp.int32:
        raise ValueError(f"block_tables int32 [S, max_blocks] and seq_lens int32 [S] disagree: "
                         f"{block_tables.dtype}{block_tables.shape}, "
                         f"{seq_lens.dtype}{seq_lens.shape}")
    if is_concrete(block_tables, seq_lens):
        check_page_ids(block_tables, pool.shape[0])
        check_seq_lens(seq_lens, block_tables.shape[1], pool.shape[1])
    return ops, latent_layout(kv_lora_rank, q.shape[2] - kv_lora_rank, **options)


def mla_decode_attention(q: jax.Array, pool: jax.Array | QuantizedPages, block_tables: jax.Array,
                         seq_lens: jax.Array, *, kv_lora_rank: int, sm_scale: float,
                         num_splits: int | None = None, return_lse: bool = False,
                         interpret: bool = False, config: MLADecodeConfig | None = None):
    """One decode token per sequence of absorbed MLA over the paged latent pool, split-K.

    Equals ``jaxkv.attention.mla.mla_attention_reference`` with ``query_start_loc = arange(S +
    1)``: sequence s's token sits at position ``seq_lens[s] - 1`` (``seq_lens[s] == 0``: a
    padding sequence, zeros). The splits share each sequence's kept (non-null) blocks.

    Args:
      q: [S, N, Lkv + R] latent-space queries (``absorb_query``), float32/bfloat16/float16.
      pool: the layer's latent pool [num_blocks, block_size, 1, Lkv + R] (block 0 the null
        block): an array in q's dtype, or fp8 ``QuantizedPages`` (``latent_operands``); Lkv and
        R powers of two >= 16.
      block_tables: int32 [S, max_blocks] page ids in ``[0, num_blocks)``.
      seq_lens: int32 [S] kv length of each sequence including this step's token.
      kv_lora_rank: Lkv, the latent's value channels.
      sm_scale: the softmax scale.
      num_splits: programs per (sequence, head tile) along the kv axis; default
        ``default_num_splits`` with the head tiles as kv heads.
      return_lse: also return the log-sum-exp of the scaled logits.
      interpret: run in Pallas interpret mode (CPU).
      config: head and kv tiles, Triton launch parameters; default ``MLADecodeConfig()``.

    Returns:
      o_lat [S, N, Lkv] in q's dtype, and with ``return_lse`` also lse f32 [S, N] (-inf for
      padding sequences).

    Raises:
      ValueError: on inconsistent shapes or dtypes, Lkv or R not a power of two >= 16,
        ``num_splits < 1``, and, when the metadata are concrete, page ids out of range or
        lengths past the table.
    """
    ops, layout = _check_inputs(q, pool, block_tables, seq_lens, kv_lora_rank)
    config = config or MLADecodeConfig()
    if num_splits is None:
        num_splits = default_num_splits(q.shape[0], -(-q.shape[1] // config.block_h),
                                        block_tables.shape[1] * pool.shape[1], config.block_kv)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    out, lse = _mla_call(q, ops, block_tables, seq_lens, num_splits=num_splits,
                         sm_scale=float(sm_scale), interpret=interpret, config=config,
                         layout=layout, kv_lora_rank=kv_lora_rank)
    return (out, lse) if return_lse else out


def mla_decode_step(q: jax.Array, pool: jax.Array | QuantizedPages, block_tables: jax.Array,
                    seq_lens: jax.Array, query_start_loc: jax.Array, **options) -> jax.Array:
    """A decode-only ragged step (``AttentionMetadata.decode_only``: sequence s's one token is
    ``q[s]``) through ``mla_decode_attention``.

    Args:
      q: [T, N, Lkv + R] (tokens past the sequences' are padding).
      query_start_loc: int32 [S + 1]; a sequence with no query token attends to nothing.
      **options: as in ``mla_decode_attention`` (``kv_lora_rank``, ``sm_scale``, ...).

    Returns:
      o_lat [T, N, Lkv] in q's dtype (zeros for padding tokens).
    """
    T, S = q.shape[0], block_tables.shape[0]
    has_q = query_start_loc[1:] > query_start_loc[:-1]                           # [S]
    out = mla_decode_attention(pad_rows(q, S), pool, block_tables,
                               jnp.where(has_q, seq_lens, 0), **options)
    return pad_rows(out, T)                                   # sequence s's row is token s
