"""Paged decode attention on GPU with split-K (flash-decoding), Pallas (Triton lowering).

Design notes: docs/attention.md."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.attention.pallas.kv_format import KvLayout, kv_operands
from jaxkv.attention.pallas.kv_walk import attend_tiles, finalize, init_carry, kv_walk, split_steps
from jaxkv.attention.pallas.ragged import (check_kv_inputs, check_options, check_page_ids,
                                           check_seq_lens, check_tuning, is_concrete,
                                           kept_operands, next_pow2, whole_block)
from jaxkv.attention.reference import check_sink_queries, merge_attention_states

# SMs of an H100 / H200 SXM: the target when the default device is not a GPU (interpret mode,
# the deviceless compile check)
_H100_SMS = 132


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tuning of the decode kernel (static; one compilation per distinct value).

    Attributes:
      block_kv: kv positions per kv tile (power of two >= 16).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the kv loop.
    """

    block_kv: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_tuning(self, ("block_kv", "num_warps"))


def target_sm_count() -> int:
    """SMs of the GPU the kernel is compiled for: the abstract mesh's device (a deviceless
    compile under ``jax.sharding.use_abstract_mesh``), else the default device when it is a
    GPU, else an H100's 132."""
    abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if getattr(abstract, "num_cores", None):
        return abstract.num_cores
    device = jax.devices()[0]
    return (getattr(device, "core_count", 0) if device.platform == "gpu" else 0) or _H100_SMS


def default_num_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, block_kv: int,
                       num_sms: int | None = None) -> int:
    """Splits so that ``S * Hkv * splits`` reaches ~2 programs per SM, each with >= 2 kv tiles.

    Args:
      num_seqs: S.
      num_kv_heads: Hkv.
      max_kv_len: the longest kv length the block table can hold (max_blocks * block_size).
      block_kv: kv positions per tile.
      num_sms: the target's SM count; default ``target_sm_count()``.

    Returns:
      A power of two in ``[1, 64]``.
    """
    programs = 2 * (num_sms or target_sm_count())
    want = next_pow2(max(1, -(-programs // (num_seqs * num_kv_heads))))
    most = max(1, max_kv_len // (2 * block_kv))
    return max(1, min(want, 1 << (most.bit_length() - 1), 64))


def split_k_outputs(num_splits: int, S: int, Hkv: int, G_pad: int, D: int) -> dict:
    """``out_specs`` / ``out_shape`` of a split-K decode grid (S, Hkv, num_splits): per split
    a normalized f32 [G_pad, D] output and f32 [G_pad] lse for each (sequence, kv head)."""
    return dict(
        out_specs=[pl.BlockSpec((None, None, None, G_pad, D), lambda s, h, j: (j, s, h, 0, 0)),
                   pl.BlockSpec((None, None, None, G_pad), lambda s, h, j: (j, s, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_splits, S, Hkv, G_pad, D), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, S, Hkv, G_pad), jnp.float32)])


def merge_splits(outs, lses, G: int, q):
    """(out [S, Hq, D] in q's dtype, lse f32 [S, Hq]) of the splits' f32 [N, S, Hkv, G_pad, D]
    outputs and [N, S, Hkv, G_pad] lses (``merge_attention_states`` over N; padding rows
    dropped)."""
    S, Hq, D = q.shape
    outs, lses = outs[:, :, :, :G], lses[:, :, :, :G]           # [N, S, Hkv, G, D], [N, S, Hkv, G]
    out, lse = (outs[0], lses[0]) if outs.shape[0] == 1 else merge_attention_states(outs, lses)
    return out.reshape(S, Hq, D).astype(q.dtype), lse.reshape(S, Hq)


def _decode_kernel(
    # inputs
    q_ref,       # [G_pad, D] the kv-head group of one sequence's token
    tables_ref,  # int32 [S, max_blocks]
    lens_ref,    # int32 [S]
    *refs,       # inputs: [without a window: kept_blocks' order int32 [S, max_blocks] and
                 #   kept_before int32 [S, max_blocks + 1]], [the sink queries [G_pad, D] if
                 #   rescore] and the kv operands of kv_format.kv_operands; outputs: o f32
                 #   [G_pad, D] normalized partial output of this split, lse f32 [G_pad] (-inf
                 #   if it saw nothing)
    num_splits: int, block_kv: int, sm_scale: float, sliding_window: int | None,
    num_sinks: int, soft_cap: float | None, layout: KvLayout, rescore: bool):
    kept_refs, refs = (refs[:2], refs[2:]) if sliding_window is None else ((), refs)
    qs_ref, refs = (refs[0], refs[1:]) if rescore else (None, refs)
    *kv_refs, o_ref, lse_ref = refs
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = q_ref.shape[0]
    kv_len = lens_ref[seq]
    q_pos = jnp.full((rows,), kv_len - 1, jnp.int32)                            # [rows]
    tile_at, sink_tiles, count = kv_walk(
        seq, kv_len - 1, kv_len, kept_refs, block_kv=block_kv, block_size=kv_refs[0].shape[1],
        max_blocks=tables_ref.shape[1], sliding_window=sliding_window, num_sinks=num_sinks)
    v_start, v_stop = split_steps(count, split, num_splits)
    q = tuple(q_ref[:, pl.ds(c[0], c[1])] for c in layout.chunks)               # [rows, w] each
    qs = None if qs_ref is None else tuple(qs_ref[:, pl.ds(c[0], c[1])] for c in layout.chunks)
    carry = attend_tiles(q, q_pos, seq, kv_len, head, kv_refs, tables_ref,
                         init_carry(rows, layout), v_start, v_stop, tile_at, sink_tiles,
                         sm_scale=sm_scale, sliding_window=sliding_window, num_sinks=num_sinks,
                         soft_cap=soft_cap, layout=layout, q_sinks=qs)
    out, lse = finalize(carry)
    for (ch0, width, _, _), o in zip(layout.chunks, out):
        o_ref[:, pl.ds(ch0, width)] = o
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=(
    "num_splits", "sm_scale", "sliding_window", "num_sinks", "soft_cap", "interpret", "config",
    "layout"))
def _decode_call(q, q_sinks, kv_ops, block_tables, seq_lens, *, num_splits, sm_scale,
                 sliding_window, num_sinks, soft_cap, interpret, config, layout):
    S, Hq, D = q.shape
    Hkv = kv_ops[0].shape[2]
    G = Hq // Hkv
    G_pad = max(16, next_pow2(G))

    def groups(x):                                                   # [S, Hkv, G_pad, D]
        return jnp.pad(x.reshape(S, Hkv, G, D), ((0, 0), (0, 0), (0, G_pad - G), (0, 0)))

    q4 = groups(q)
    kept = kept_operands(block_tables, sliding_window)
    sinks = () if q_sinks is None else (groups(q_sinks),)
    q_spec = pl.BlockSpec((None, None, G_pad, D), lambda s, h, j: (s, h, 0, 0))

    kernel = functools.partial(
        _decode_kernel, num_splits=num_splits, block_kv=config.block_kv, sm_scale=sm_scale,
        sliding_window=sliding_window, num_sinks=num_sinks, soft_cap=soft_cap,
        layout=layout, rescore=bool(sinks))
    outs, lses = pl.pallas_call(
        kernel,
        grid=(S, Hkv, num_splits),
        in_specs=[q_spec] + [whole_block(a.shape) for a in (block_tables, seq_lens, *kept)]
        + [q_spec] * len(sinks) + [whole_block(a.shape) for a in kv_ops],
        **split_k_outputs(num_splits, S, Hkv, G_pad, D),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="jaxkv_paged_decode_attention",
    )(q4, block_tables, seq_lens, *kept, *sinks, *kv_ops)

    return merge_splits(outs, lses, G, q)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, seq_lens: jax.Array, *,
                           num_splits: int | None = None, sm_scale: float | None = None,
                           sliding_window: int | None = None, num_sinks: int = 0,
                           soft_cap: float | None = None, return_lse: bool = False,
                           interpret: bool = False, config: DecodeConfig | None = None,
                           q_sinks: jax.Array | None = None):
    """One decode token per sequence over a paged KV cache, split-K across programs.

    Equals ``jaxkv.attention.reference.paged_attention_reference`` with ``query_start_loc = arange(S
    + 1)``: the token of sequence s sits at kv position ``seq_lens[s] - 1`` (sequences with
    ``seq_lens[s] == 0`` are padding and give zeros). Without a window the splits share only
    each sequence's kept (non-null) blocks.

    Args:
      q: [S, num_heads, head_dim] float32/bfloat16/float16, one query token per sequence.
      k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype; one layer's
        page pool (block 0 is the null block), or fp8/int8 ``jaxkv.kvcache.pools.QuantizedPages``
        (dequantized in-kernel). head_dim must be a power of two >= 16.
      block_tables: int32 [S, max_blocks] page ids in ``[0, num_blocks)`` (padding entries 0).
      seq_lens: int32 [S] kv length of each sequence including this step's token.
      num_splits: programs per (sequence, kv head) along the kv axis (split-K); default
        ``default_num_splits`` from the shapes.
      sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
      sliding_window: attend to the last ``sliding_window`` positions only (itself included).
      num_sinks: with a window, the first ``num_sinks`` positions stay visible (attention sinks).
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      return_lse: also return the log-sum-exp of the (scaled, capped) logits.
      interpret: run in Pallas interpret mode (CPU).
      config: kv tile size and Triton launch parameters; default ``DecodeConfig()``.
      q_sinks: optional, like q: with a window, the queries that score the first
        ``num_sinks`` positions (StreamingLLM's positions within the cache); default q.

    Returns:
      out [S, num_heads, head_dim] in q's dtype, and with ``return_lse`` also lse float32
      [S, num_heads] (-inf for padding sequences).

    Raises:
      ValueError: on inconsistent shapes, dtypes or options, ``num_splits < 1``, and, when the
        metadata are concrete (not traced), page ids out of range or lengths past the table.
    """
    if q.ndim != 3 or q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q must be [S, num_heads, head_dim] with S = {block_tables.shape[0]} "
                         f"(block_tables rows), got shape {q.shape}")
    kv_ops, layout = kv_operands(k_pages, v_pages)
    check_kv_inputs(q.shape, q.dtype, k_pages, v_pages, block_tables, seq_lens)
    check_options(sm_scale, sliding_window, num_sinks, soft_cap)
    check_sink_queries(q, q_sinks)
    config = config or DecodeConfig()
    S, _, D = q.shape
    _, block_size, Hkv, _ = k_pages.shape
    if num_splits is None:
        num_splits = default_num_splits(S, Hkv, block_tables.shape[1] * block_size,
                                        config.block_kv)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    if is_concrete(block_tables, seq_lens):
        check_page_ids(block_tables, k_pages.shape[0])
        check_seq_lens(seq_lens, block_tables.shape[1], block_size)
    rescore = q_sinks is not None and sliding_window is not None and num_sinks > 0
    out, lse = _decode_call(
        q, q_sinks if rescore else None, kv_ops, block_tables, seq_lens, num_splits=num_splits,
        layout=layout,
        sm_scale=1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale),
        sliding_window=sliding_window, num_sinks=num_sinks if sliding_window is not None else 0,
        soft_cap=soft_cap, interpret=interpret, config=config)
    return (out, lse) if return_lse else out


def decode_step_attention(q: jax.Array, k_pages, v_pages, block_tables: jax.Array,
                          seq_lens: jax.Array, query_start_loc: jax.Array, *,
                          return_lse: bool = False, q_sinks: jax.Array | None = None,
                          **options):
    """A decode-only ragged step through the split-K kernel: ``ragged_paged_attention``'s
    signature and result for a step whose sequence s has at most one query token, ``q[s]``
    (``query_start_loc[s] = s`` up to the padding sequences, which have none).

    The ragged kernel's grid at batch S is ``S x Hkv`` programs (8 of an H100's 132 SMs for
    one Llama-3-8B sequence); split-K adds ``default_num_splits`` programs along the kv axis.

    Args:
      q: [T, Hq, D] (T may differ from S: tokens past the real ones are padding).
      query_start_loc: int32 [S + 1]; a sequence with no query token attends to nothing.
      q_sinks, return_lse, **options: as in ``paged_decode_attention``.

    Returns:
      out [T, Hq, D] (zeros for padding tokens), and with ``return_lse`` also lse f32 [T, Hq]
      (-inf for padding tokens).
    """
    T, S = q.shape[0], block_tables.shape[0]
    has_q = query_start_loc[1:] > query_start_loc[:-1]                           # [S]
    out, lse = paged_decode_attention(
        pad_rows(q, S), k_pages, v_pages, block_tables, jnp.where(has_q, seq_lens, 0),
        return_lse=True, q_sinks=None if q_sinks is None else pad_rows(q_sinks, S), **options)
    out, lse = pad_rows(out, T), pad_rows(lse, T, -jnp.inf)        # sequence s's row is token s
    return (out, lse) if return_lse else out


def pad_rows(x, n: int, fill=0):
    """x's first n rows, padded with ``fill`` to n: [n, ...]."""
    m = min(n, x.shape[0])
    return jnp.pad(x[:m], ((0, n - m),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)
