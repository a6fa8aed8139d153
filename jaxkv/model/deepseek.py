"""DeepSeek-V2/V3's feed-forward and checkpoint names: past ``first_k_dense_replace`` a layer's
MLP is routed experts (jaxkv/model/moe.py's grouped products) plus shared experts every token
runs; the router scores by softmax (V2) or by sigmoid with a learned choice bias (V3), limits a
token's experts to its best groups, and scales the weights (``routed_scaling_factor``).

Attention is multi-head latent attention (jaxkv/model/mla.py). Design notes: docs/runtime.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxkv.model import mla, moe
from jaxkv.model.config import ModelConfig
from jaxkv.model.linear import linear


def _param(shape, dtype, axes):
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


def route(logits: jax.Array, c: ModelConfig, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """DeepSeek's router (HF's ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``).

    Scores ``softmax`` (V2) or ``sigmoid`` (V3) of the logits; the choice adds ``bias`` (V3's
    ``e_score_correction_bias``); with groups, each group is rated by its best choice (V2) or
    its two best summed (V3), and experts outside a token's ``topk_groups`` best groups are
    masked (to 0: V2, -inf: V3); the top-k choices' *scores* (bias-free) are the weights,
    renormalised with ``norm_topk_prob``, times ``routed_scaling_factor``.

    Args:
      logits: f32 [T, X]; bias: f32 [X] or None.

    Returns:
      (weights f32 [T, k], experts int32 [T, k]).
    """
    T, X = logits.shape
    sigmoid = c.router_scoring == "sigmoid"
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    G = c.num_expert_groups
    if G > 1:
        grouped = choice.reshape(T, G, X // G)
        rating = (lax.top_k(grouped, 2)[0].sum(-1) if sigmoid else grouped.max(-1))   # [T, G]
        best = lax.top_k(rating, c.topk_groups)[1]                                    # [T, g]
        keep = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], best].set(True)
        choice = jnp.where(jnp.repeat(keep, X // G, axis=1), choice,
                           -jnp.inf if sigmoid else 0.0)
    experts = lax.top_k(choice, c.num_experts_per_tok)[1]                            # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * c.routed_scaling_factor, experts.astype(jnp.int32)


class DeepseekMoE(nnx.Module):
    """Routed experts (router [E, X], V3's ``score_bias`` [X]; gate and up [X, E, F], down
    [X, F, E]) and the shared experts, one SwiGLU of width ``num_shared_experts x F`` built
    by ``mlp`` (the decoder's MLP class)."""

    def __init__(self, c: ModelConfig, dtype, mlp):
        E, F, X = c.hidden_size, c.expert_size, c.num_experts
        self.router = _param((E, X), dtype, ("embed", "experts"))
        if c.router_scoring == "sigmoid":
            self.score_bias = _param((X,), dtype, ("experts",))
        self.gate_proj = _param((X, E, F), dtype, ("experts", "embed", "mlp"))
        self.up_proj = _param((X, E, F), dtype, ("experts", "embed", "mlp"))
        self.down_proj = _param((X, F, E), dtype, ("experts", "mlp", "embed"))
        if c.num_shared_experts:
            self.shared_experts = mlp(dataclasses.replace(
                c, intermediate_size=F * c.num_shared_experts), dtype)
        self.config = c

    def __call__(self, x):  # [T, E]
        c = self.config
        logits = linear(x.astype(jnp.float32), self.router[...].astype(jnp.float32))  # [T, X]
        bias = self.score_bias[...] if c.router_scoring == "sigmoid" else None
        weights, experts = route(logits, c, bias)                                    # [T, k]
        out = moe.experts_mlp(x, weights, experts, self.gate_proj[...], self.up_proj[...],
                              self.down_proj[...])
        if c.num_shared_experts:
            out = out + self.shared_experts(x)
        return out


def hf_layer_map(c: ModelConfig, i: int) -> dict:
    """HF names of DeepSeek layer i's tensors -> (params path, converter from [out, in]): its
    norms, MLA (``mla.hf_attention_map``) and dense MLP or experts (X per-expert matrices, a
    tuple of names, stacked into [X, in, out])."""
    p, a = f"model.layers.{i}.", ("layers", i)
    m = {p + f"{n}.weight": (a + (n, "weight"), _same)
         for n in ("input_layernorm", "post_attention_layernorm")}
    m |= mla.hf_attention_map(c, i)
    mlp = [("mlp.", a + ("mlp",))]
    if c.is_moe_layer(i):
        mlp = [("mlp.shared_experts.", a + ("mlp", "shared_experts"))] * bool(
            c.num_shared_experts)
        e = p + "mlp."
        m[e + "gate.weight"] = (a + ("mlp", "router"), _transpose)
        if c.router_scoring == "sigmoid":
            m[e + "gate.e_score_correction_bias"] = (a + ("mlp", "score_bias"), _same)
        for n in ("gate_proj", "up_proj", "down_proj"):
            names = tuple(f"{e}experts.{x}.{n}.weight" for x in range(c.num_experts))
            m[names] = (a + ("mlp", n), _stack_t)
    for prefix, path in mlp:
        for n in ("gate_proj", "up_proj", "down_proj"):
            m[p + prefix + n + ".weight"] = (path + (n,), _transpose)
    return m


def _same(w):
    return w


def _transpose(w):
    return w.T


def _stack_t(*ws):
    return np.stack([w.T for w in ws])

