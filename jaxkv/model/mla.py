"""DeepSeek's multi-head latent attention (MLA) as a decoder layer's attention: each token
writes one latent "head" ``[c_kv | k_rope]`` (``Lkv + R`` values) to its layer's paged pool,
and its query heads attend to the latents (jaxkv/attention/mla.py); the HF checkpoint's names.

Shapes (V3): E hidden, N heads, P = 128 unrotated and R = 64 rotated query/key channels,
V = 128 value channels, Lkv = 512 latent, Lq = 1536 query latent. Design notes:
docs/kv-cache.md ("The latent cache").
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.mla import mla_attention
from jaxkv.attention.mla_prefill import expanded_min_tokens, mla_prefill_attention
from jaxkv.attention.options import AttentionOptions
from jaxkv.attention.reference import token_layout
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pools import write_layer
from jaxkv.model.config import ModelConfig
from jaxkv.model.linear import linear
from jaxkv.model.rope import rotate, yarn_mscale

# HF creates q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, not the config's
LATENT_NORM_EPS = 1e-6


def _param(shape, dtype, axes):
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


def softmax_scale(c: ModelConfig) -> float:
    """``(P + R) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN with
    ``mscale_all_dim`` (HF's ``yarn_apply_mscale``: V3 0.1352, V2 0.1147)."""
    scale = (c.mla.qk_nope_head_dim + c.mla.qk_rope_head_dim) ** -0.5
    rs = c.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


class LatentAttention(nnx.Module):
    """MLA's projections: q (``q_proj`` [E, N, P + R], or with q LoRA ``q_a_proj`` [E, Lq],
    its norm and ``q_b_proj`` [Lq, N, P + R]), the latent's ``kv_a_proj`` [E, Lkv + R] and
    norm, ``kv_b_proj`` split into ``k_up`` (W_UK [Lkv, N, P]) and ``v_up`` (W_UV [Lkv, N, V]),
    and ``o_proj`` [N, V, E]. ``norm``: the decoder's RMSNorm class."""

    def __init__(self, c: ModelConfig, dtype, norm):
        m, E, N = c.mla, c.hidden_size, c.num_heads
        Dq, Lkv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank
        if m.q_lora_rank:
            self.q_a_proj = _param((E, m.q_lora_rank), dtype, ("embed", None))
            self.q_a_layernorm = norm(m.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = _param((m.q_lora_rank, N, Dq), dtype, (None, "heads", "head_dim"))
        else:
            self.q_proj = _param((E, N, Dq), dtype, ("embed", "heads", "head_dim"))
        self.kv_a_proj = _param((E, m.latent_dim), dtype, ("embed", None))
        self.kv_a_layernorm = norm(Lkv, LATENT_NORM_EPS, dtype)
        self.k_up = _param((Lkv, N, m.qk_nope_head_dim), dtype, (None, "heads", "head_dim"))
        self.v_up = _param((Lkv, N, m.v_head_dim), dtype, (None, "heads", "head_dim"))
        self.o_proj = _param((N, m.v_head_dim, E), dtype, ("heads", "head_dim", "embed"))
        self.mla, self.scale = m, softmax_scale(c)

    def __call__(self, x, rot, pools, md: AttentionMetadata, *, sink_rot=None,
                 options: AttentionOptions, impl, interpret, attention, sparse=None,
                 row_queries: int = 1):
        """``llama.Attention``'s call on a latent pool: ``pools`` = (latent pool, the zero-width
        V pool, None); returns (output [T, E], pools, None)."""
        _check_options(options, sparse, sink_rot)
        m = self.mla
        if m.q_lora_rank:
            q = linear(self.q_a_layernorm(linear(x, self.q_a_proj[...])), self.q_b_proj[...])
        else:
            q = linear(x, self.q_proj[...])                                # [T, N, P + R]
        q_nope, q_rope = q[..., :m.qk_nope_head_dim], rotate(q[..., m.qk_nope_head_dim:], rot)
        kv = linear(x, self.kv_a_proj[...])                                # [T, Lkv + R]
        c_kv = self.kv_a_layernorm(kv[:, :m.kv_lora_rank])
        k_rope = rotate(kv[:, None, m.kv_lora_rank:], rot)                 # [T, 1, R]
        latent = jnp.concatenate([c_kv[:, None, :], k_rope], axis=-1)      # [T, 1, Lkv + R]
        pool = write_layer(pools[0], latent, md.slot_mapping, md)
        # tensor parallel (``sharding.ShardedAttention``): each device its heads, whole latent
        over_heads = getattr(attention, "over_heads", None)
        attend = functools.partial(
            _attend, mla=m, sm_scale=self.scale, impl=impl, interpret=interpret,
            attention=attention if over_heads is None else paged_attention,
            row_queries=row_queries)
        heads = (q_nope, q_rope, self.k_up[...], self.v_up[...])
        o = (attend(*heads, pool, md) if over_heads is None
             else over_heads(attend, heads, pool, md))                     # [T, N, V]
        w_o = self.o_proj[...]
        out = linear(o.reshape(o.shape[0], -1), w_o.reshape(-1, w_o.shape[-1]))
        return out, (pool, pools[1], pools[2]), None


def _attend(q_nope, q_rope, k_up, v_up, pool, md: AttentionMetadata, *, mla, sm_scale,
            impl, **kw):
    """MLA's two forms, chosen per step and sequence: a step that may hold a sequence of
    ``expanded_min_tokens`` query tokens (not decode-only, a token bucket that wide) runs
    such sequences expanded (jaxkv/attention/mla_prefill.py) and the rest absorbed, the
    expanded ones' kv lengths zeroed for the absorbed pass; other steps run absorbed only.
    q_nope [T, N, P], q_rope [T, N, R], k_up [Lkv, N, P], v_up [Lkv, N, V] (N: the heads
    this device computes). Returns o [T, N, V]."""
    min_tokens = expanded_min_tokens(mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim)
    if md.decode_only or q_nope.shape[0] < min_tokens:
        return mla_attention(q_nope, q_rope, pool, k_up, v_up, md, sm_scale=sm_scale,
                             impl=impl, **kw)
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    chosen = q_lens >= min_tokens                                      # [S]
    absorbed = dataclasses.replace(md, seq_lens=jnp.where(chosen, 0, md.seq_lens))
    o = mla_attention(q_nope, q_rope, pool, k_up, v_up, absorbed, sm_scale=sm_scale,
                      impl=impl, **kw)
    o_exp = mla_prefill_attention(q_nope, q_rope, pool, k_up, v_up, md.block_tables,
                                  md.seq_lens, md.query_start_loc, chosen, sm_scale=sm_scale)
    seq, _, valid = token_layout(md.query_start_loc, md.seq_lens, o.shape[0])
    expanded = chosen[seq] & valid                                     # [T]
    return jnp.where(expanded[:, None, None], o_exp.astype(o.dtype), o)


def _check_options(options: AttentionOptions, sparse, sink_rot) -> None:
    """Raises ValueError naming the option an MLA layer cannot serve yet (at trace time)."""
    if sparse is not None:
        raise ValueError("sparse_attention='quest' is not supported for an MLA model yet")
    if (options.sliding_window, options.num_sinks, options.observe, sink_rot) != (
            None, 0, 0, None):
        raise ValueError("kv_retention: a KV retention policy is not supported for an MLA model "
                         "yet; supported: 'full'")


def rope_order(dim: int) -> np.ndarray:
    """The rotary channels' order that turns DeepSeek's interleaved pairs ``(2i, 2i + 1)`` into
    rotate-half's halves ``(i, i + dim / 2)``: evens, then odds (HF V3's
    ``apply_rotary_pos_emb_interleave`` outputs the same order; V2's complex pairs the same
    rotation)."""
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


def hf_attention_map(c: ModelConfig, i: int) -> dict:
    """HF names of layer i's MLA tensors -> (params path, converter from [out, in]); the rotary
    rows reordered (``rope_order``), ``kv_b_proj`` [N (P + V), Lkv] split into W_UK and W_UV
    (a 1-tuple key names the same tensor a second time)."""
    m, E, N = c.mla, c.hidden_size, c.num_heads
    P, R, V, Lkv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    order = rope_order(R) if m.rope_interleave else np.arange(R)
    q_cols = np.concatenate([np.arange(P), P + order])         # within each head's P + R
    kv_rows = np.concatenate([np.arange(Lkv), Lkv + order])
    p, a = f"model.layers.{i}.self_attn.", ("layers", i, "self_attn")

    def heads(w):                                              # [N (P + R), X] -> [X, N, P + R]
        return w.reshape(N, P + R, -1)[:, q_cols].transpose(2, 0, 1)

    def up(w, lo, hi):                                         # [N (P + V), Lkv] -> [Lkv, N, .]
        return w.reshape(N, P + V, Lkv)[:, lo:hi].transpose(2, 0, 1)

    out = {
        p + "kv_a_proj_with_mqa.weight": (a + ("kv_a_proj",), lambda w: w[kv_rows].T),
        p + "kv_a_layernorm.weight": (a + ("kv_a_layernorm", "weight"), lambda w: w),
        p + "kv_b_proj.weight": (a + ("k_up",), lambda w: up(w, 0, P)),
        (p + "kv_b_proj.weight",): (a + ("v_up",), lambda w: up(w, P, P + V)),
        p + "o_proj.weight": (a + ("o_proj",), lambda w: w.T.reshape(N, V, E)),
    }
    if m.q_lora_rank:
        return out | {
            p + "q_a_proj.weight": (a + ("q_a_proj",), lambda w: w.T),
            p + "q_a_layernorm.weight": (a + ("q_a_layernorm", "weight"), lambda w: w),
            p + "q_b_proj.weight": (a + ("q_b_proj",), heads)}
    return out | {p + "q_proj.weight": (a + ("q_proj",), heads)}
