"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3; Mixtral and Qwen3-MoE
with jaxkv/model/moe.py) in Flax NNX over a paged KV cache.

Design notes: docs/runtime.md."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.layer import attend
from jaxkv.attention.options import AttentionOptions, QuestOptions
from jaxkv.kvcache import pages as kvcache
from jaxkv.kvcache.key_bounds import refresh_key_bounds
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pools import write_layer
from jaxkv.model import deepseek, mla, moe
from jaxkv.model.architectures import ARCHITECTURES
from jaxkv.model.config import ModelConfig
from jaxkv.model.linear import linear, linear_t, linears
from jaxkv.model.quantized import QuantizedWeight, rows, stack, to_device
from jaxkv.model.rope import attention_factor, inv_frequencies, rotate, rotation

_List = getattr(nnx, "List", list)   # flax >= 0.12 wants module lists wrapped


def _param(shape, dtype, axes):
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    """``w * x / rms(x)``; Gemma's (``offset``) scales by ``1 + w`` in float32, then casts."""

    def __init__(self, dim: int, eps: float, dtype, offset: bool = False):
        self.weight = _param((dim,), dtype, ("norm",))
        self.eps, self.offset = eps, offset

    def __call__(self, x):  # [..., dim]
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * xf.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, c: ModelConfig, dtype):
        E, Hq, Hkv, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = _param((E, Hq, D), dtype, ("embed", "heads", "head_dim"))
        self.k_proj = _param((E, Hkv, D), dtype, ("embed", "kv_heads", "head_dim"))
        self.v_proj = _param((E, Hkv, D), dtype, ("embed", "kv_heads", "head_dim"))
        self.o_proj = _param((Hq, D, E), dtype, ("heads", "head_dim", "embed"))
        if c.attention_bias:
            self.q_bias = _param((Hq, D), dtype, ("heads", "head_dim"))
            self.k_bias = _param((Hkv, D), dtype, ("kv_heads", "head_dim"))
            self.v_bias = _param((Hkv, D), dtype, ("kv_heads", "head_dim"))
        self.bias = c.attention_bias
        if c.qk_norm:     # Qwen3, Gemma 3: RMSNorm over head_dim, one weight for the heads
            self.q_norm = RMSNorm(D, c.rms_norm_eps, dtype, c.gemma)
            self.k_norm = RMSNorm(D, c.rms_norm_eps, dtype, c.gemma)
        self.qk_norm = c.qk_norm
        if c.attention_sinks:   # gpt-oss: a learned logit per head in each softmax
            self.sinks = _param((Hq,), dtype, ("heads",))
            self.o_bias = _param((E,), dtype, ("embed",))
        self.sinks_on = c.attention_sinks

    def __call__(self, x, rot, pools, md: AttentionMetadata, *, sink_rot=None,
                 options: AttentionOptions, impl, interpret, attention=paged_attention,
                 sparse: QuestOptions | None = None, row_queries: int = 1):
        """One layer's attention; ``rot``: the tokens' RoPE rotation (``rope.rotation``),
        ``sink_rot``: the one that scores the sinks (StreamingLLM's positions within the cache,
        with ``options.sink_position_cap``); ``pools`` = (k_pool, v_pool, KeyBounds or None);
        ``row_queries``: the attention's layout hint (``jaxkv.attention.dispatch``). Returns
        (output [T, E], (k_pool, v_pool, bounds), block mass f32 [S, max_blocks] or None)."""
        q, k, v = linears(x, (self.q_proj[...], self.k_proj[...],      # [T, Hq, D],
                              self.v_proj[...]))                      # [T, Hkv, D] x 2
        if self.bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.qk_norm:                                              # per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q_sinks = None if sink_rot is None else rotate(q, sink_rot)   # StreamingLLM's sinks
        q = rotate(q, rot)
        k = rotate(k, rot)
        k_pool = write_layer(pools[0], k, md.slot_mapping, md)
        v_pool = write_layer(pools[1], v, md.slot_mapping, md)
        bounds = pools[2]
        if bounds is not None:
            bounds = refresh_key_bounds(bounds, k_pool, md.slot_mapping,
                                                md.seq_lens.shape[0])
        o, mass = attend(q, k_pool, v_pool, bounds, md, options=options, impl=impl,
                         interpret=interpret, attention=attention, sparse=sparse,
                         row_queries=row_queries, q_sinks=q_sinks,
                         sink_logits=self.sinks[...] if self.sinks_on else None)
        # one [T, Hq * D] @ [Hq * D, E] dot (both reshapes are bitcasts), so XLA transposes
        # the small activation, not the weight, when attention leaves o in another layout
        w_o = self.o_proj[...]
        out = linear(o.reshape(o.shape[0], -1), w_o.reshape(-1, w_o.shape[-1]))
        if self.sinks_on:
            out = out + self.o_bias[...]
        return out, (k_pool, v_pool, bounds), mass


class MLP(nnx.Module):
    def __init__(self, c: ModelConfig, dtype):
        E, F = c.hidden_size, c.intermediate_size
        self.gate_proj = _param((E, F), dtype, ("embed", "mlp"))
        self.up_proj = _param((E, F), dtype, ("embed", "mlp"))
        self.down_proj = _param((F, E), dtype, ("mlp", "embed"))
        self.gelu = c.gemma                        # GELU (tanh), HF's gelu_pytorch_tanh

    def __call__(self, x):  # [T, E]
        gate, up = linears(x, (self.gate_proj[...], self.up_proj[...]))   # [T, F] x 2
        act = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return linear(act * up, self.down_proj[...])


class MoE(nnx.Module):
    """The mixture-of-experts feed-forward (jaxkv/model/moe.py): router [E, X], experts'
    gate and up [X, E, F], down [X, F, E]; gpt-oss's (``swiglu_limit``) with biases: the
    router's [X], gate's and up's [X, F], down's [X, E]."""

    def __init__(self, c: ModelConfig, dtype):
        E, F, X = c.hidden_size, c.expert_size, c.num_experts
        self.router = _param((E, X), dtype, ("embed", "experts"))
        self.gate_proj = _param((X, E, F), dtype, ("experts", "embed", "mlp"))
        self.up_proj = _param((X, E, F), dtype, ("experts", "embed", "mlp"))
        self.down_proj = _param((X, F, E), dtype, ("experts", "mlp", "embed"))
        self.top_k, self.normalize = c.num_experts_per_tok, c.norm_topk_prob
        self.gpt_oss = c.swiglu_limit is not None
        self.act = (functools.partial(moe.clamped_swiglu, alpha=c.swiglu_alpha,
                                      limit=c.swiglu_limit) if self.gpt_oss else moe.swiglu)
        if self.gpt_oss:
            self.router_bias = _param((X,), dtype, ("experts",))
            self.gate_bias = _param((X, F), dtype, ("experts", "mlp"))
            self.up_bias = _param((X, F), dtype, ("experts", "mlp"))
            self.down_bias = _param((X, E), dtype, ("experts", "embed"))

    def __call__(self, x):  # [T, E]
        logits = linear(x, self.router[...])                                # [T, X]
        biases = None
        if self.gpt_oss:
            logits = logits + self.router_bias[...]
            biases = (self.gate_bias[...], self.up_bias[...], self.down_bias[...])
        weights, experts = moe.route(logits.astype(jnp.float32), self.top_k, self.normalize,
                                     topk_first=self.gpt_oss)             # [T, k] x 2
        return moe.experts_mlp(x, weights, experts, self.gate_proj[...], self.up_proj[...],
                               self.down_proj[...], biases=biases, act=self.act)


class DecoderLayer(nnx.Module):
    def __init__(self, c: ModelConfig, dtype, index: int):
        norm = functools.partial(RMSNorm, c.hidden_size, c.rms_norm_eps, dtype, c.gemma)
        self.input_layernorm = norm()
        self.self_attn = (mla.LatentAttention(c, dtype, RMSNorm) if c.mla   # DeepSeek: MLA
                          else Attention(c, dtype))
        self.post_attention_layernorm = norm()   # Gemma: of the attention's output
        if c.gemma:                              # Gemma: the MLP between two norms of its own
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.gemma = c.gemma
        self.mlp = MoE(c, dtype) if c.is_moe_layer(index) else MLP(c, dtype)
        if c.mla and c.is_moe_layer(index):     # DeepSeek's routed + shared experts
            self.mlp = deepseek.DeepseekMoE(c, dtype, MLP)


def _decoder_layer(graphdef, state, x, rot, sink_rot, pools, md: AttentionMetadata, *,
                   options: AttentionOptions, impl, interpret, attention,
                   sparse: QuestOptions | None, row_queries: int):
    """One decoder layer on the residual stream x [T, E]; returns (x [T, E], the layer's
    updated (k_pool, v_pool, bounds), block mass f32 [S, max_blocks] or None)."""
    layer = nnx.merge(graphdef, state)
    h, pools, mass = layer.self_attn(
        layer.input_layernorm(x), rot, pools, md, sink_rot=sink_rot, options=options,
        impl=impl, interpret=interpret, attention=attention, sparse=sparse,
        row_queries=row_queries)
    if layer.gemma:
        x = x + layer.post_attention_layernorm(h)
        return x + layer.post_feedforward_layernorm(
            layer.mlp(layer.pre_feedforward_layernorm(x))), pools, mass
    x = x + h
    return x + layer.mlp(layer.post_attention_layernorm(x)), pools, mass


def _traced_once(fn):
    """``fn`` under a jit of its own, new for each trace of the model: every layer has the same
    graph and shapes, so the layers share one trace and one lowered function (start-up: a step
    variant traces in ~0.1 s, not ~0.6 s), and XLA inlines the calls, so the compiled step is
    the same. A fresh wrapper per trace keeps what a layer decides at trace time (the CPU
    kernels, ``linear.SMALL_ROWS``) from being reused by another engine's or a later trace."""
    @functools.wraps(fn)
    def fresh(*args, **kwargs):
        return fn(*args, **kwargs)

    return jax.jit(fresh, static_argnums=0, static_argnames=(
        "options", "impl", "interpret", "attention", "sparse", "row_queries"))


class Transformer(nnx.Module):
    """The decoder's parameter tree; call it through ``forward``."""

    def __init__(self, c: ModelConfig, dtype=jnp.float32):
        self.config = c
        self.embed_tokens = _param((c.vocab_size, c.hidden_size), dtype, ("vocab", "embed"))
        self.layers = _List([DecoderLayer(c, dtype, i) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.gemma)
        if not c.tie_word_embeddings:
            self.lm_head = _param((c.hidden_size, c.num_logits), dtype, ("embed", "vocab"))

    def __call__(self, token_ids, positions, cache: kvcache.PagedKVCache, md: AttentionMetadata,
                 logits_indices, *, impl, interpret, attention=paged_attention,
                 options: AttentionOptions | None = None,
                 sparse: QuestOptions | None = None, row_queries: int = 1, kv_groups=None):
        c = self.config
        options = options or AttentionOptions(sliding_window=c.sliding_window)
        inv_freq = inv_frequencies(c)
        rot = rotation(positions, inv_freq, attention_factor(c))         # once for every layer
        local_rot = (rot if c.rope_local_theta is None       # Gemma 3's sliding layers' own
                     else rotation(positions, inv_frequencies(c, local=True)))
        sink_rot = (None if options.sink_position_cap is None else
                    rotation(jnp.minimum(positions, options.sink_position_cap), inv_freq,
                             attention_factor(c)))
        x = rows(self.embed_tokens[...], token_ids).astype(                # [T, E]
            self.norm.weight[...].dtype)
        if c.gemma:                      # scaled by sqrt(E), rounded to the weights' dtype
            x = x * jnp.asarray(math.sqrt(c.hidden_size), x.dtype)
        ks, vs, bs = list(cache.k), list(cache.v), list(cache.bounds)
        mass = 0.0 if options.observe else None                          # [S, max_blocks]
        decoder_layer = _traced_once(_decoder_layer)
        for i, layer in enumerate(self.layers):
            g, slot = kv_groups.place(i) if kv_groups else (0, i)   # hybrid: pages by group
            x, (ks[slot], vs[slot], bounds), layer_mass = decoder_layer(
                *nnx.split(layer), x, local_rot if c.layer_window(i) else rot, sink_rot,
                (ks[slot], vs[slot], bs[slot] if bs else None), md.for_group(g),
                options=layer_options(c, i, options), impl=impl, interpret=interpret,
                attention=attention, sparse=sparse, row_queries=row_queries)
            if bounds is not None:
                bs[slot] = bounds
            if layer_mass is not None:
                mass = mass + layer_mass
        if logits_indices is not None:
            x = x[logits_indices]                                        # [S, E]
        x = self.norm(x)
        logits = (linear_t(x, self.embed_tokens[...]) if c.tie_word_embeddings
                  else linear(x, self.lm_head[...])).astype(jnp.float32)    # [S or T, V]
        if c.final_logit_softcapping:                                    # Gemma 2
            cap = c.final_logit_softcapping
            logits = cap * jnp.tanh(logits / cap)
        cache = kvcache.PagedKVCache(k=tuple(ks), v=tuple(vs), bounds=tuple(bs))
        return (logits, cache) if mass is None else (logits, cache, mass)


def layer_options(c: ModelConfig, i: int, options: AttentionOptions) -> AttentionOptions:
    """Layer i's attention options: the step's (a retention policy's), with the model's own
    per-layer window (a full layer of a model mixing kinds drops it), scale and soft-cap."""
    if not (c.layer_types or c.query_pre_attn_scalar or c.attn_logit_softcapping):
        return options
    return dataclasses.replace(
        options, sliding_window=options.sliding_window if c.layer_window(i) else None,
        sm_scale=None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar ** -0.5,
        soft_cap=c.attn_logit_softcapping)


@functools.lru_cache(maxsize=16)
def _abstract(config: ModelConfig, dtype_name: str):
    model = nnx.eval_shape(lambda: Transformer(config, jnp.dtype(dtype_name)))
    return nnx.split(model)


def param_shapes(config: ModelConfig, dtype=jnp.float32) -> dict:
    """Nested dict of ``jax.ShapeDtypeStruct`` with the structure of the params dict."""
    return nnx.to_pure_dict(_abstract(config, jnp.dtype(dtype).name)[1])


def logical_axes(config: ModelConfig) -> dict:
    """Nested dict (params structure) of each parameter's logical axis names, e.g. ("embed", "mlp")."""
    state = _abstract(config, "float32")[1]
    axes = jax.tree_util.tree_map(lambda v: v.get_metadata()["logical_axes"], state,
                                  is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(axes)


def forward(params: dict, token_ids: jax.Array, positions: jax.Array,
            cache: kvcache.PagedKVCache, metadata: AttentionMetadata, *, config: ModelConfig,
            logits_indices: jax.Array | None = None, attention_impl: str = "reference",
            interpret: bool = False, attention=paged_attention,
            attention_options: AttentionOptions | None = None,
            sparse: QuestOptions | None = None, row_queries: int = 1, kv_groups=None
            ) -> tuple[jax.Array, kvcache.PagedKVCache] | tuple[jax.Array,
                                                                kvcache.PagedKVCache, jax.Array]:
    """Runs the decoder on one ragged step, writing its K/V into the paged cache.

    Args:
      params: nested dict of arrays shaped like ``param_shapes(config)`` (e.g. from ``params_from_hf``).
      token_ids: int32 [T] tokens of the step (prefill chunks and decode tokens, flattened).
      positions: int32 [T] position of each token in its sequence.
      cache: the paged cache; its pools are returned updated.
      metadata: slots, query starts, kv lengths and block tables of the step.
      config: the model's hyper-parameters (static).
      logits_indices: optional int32 [S]: compute logits only for these token rows.
      attention_impl: ``"reference"``, ``"grouped"`` or ``"pallas"`` (explicit; see
        jaxkv.attention.dispatch).
      interpret: Pallas interpret mode (CPU).
      attention: the paged-attention function (``paged_attention``'s signature); tensor
        parallelism passes its ``shard_map`` wrapper (jaxkv.runner.sharding.sharded_attention).
      attention_options: window, sinks, sink positions and attention statistics of a KV
        retention policy (jaxkv/retention/; static); default the model's own sliding window,
        no sinks, no statistics.
      sparse: Quest sparse decode attention (static; jaxkv/attention/quest.py): decode
        sequences attend only to their selected pages (the cache keeps ``KeyBounds`` for a
        float/fp8/int8 pool, ``KVCacheSpec.key_bounds``); None: dense attention.
      row_queries: the attention's layout hint (static; ``jaxkv.attention.dispatch``): a step that
        verifies drafts passes its logits width W = 1 + k, so each sequence's last W tokens
        read their KV together.
      kv_groups: a hybrid cache's ``jaxkv.config.kv_groups.KVGroups`` (static): layer i reads
        its pages from pool slot ``place(i)[1]`` through group ``place(i)[0]``'s slots and
        tables (``metadata.for_group``); None: one group, layer i in slot i.

    Returns:
      (logits float32 [S or T, num_logits], updated cache), and with
      ``attention_options.observe`` also the attention mass per KV block f32 [S, max_blocks]
      (``jaxkv.attention.mass``, summed over layers).
    """
    dtype = params["norm"]["weight"].dtype      # a quantized weight's leaves are its codes
    graphdef, abstract = _abstract(config, jnp.dtype(dtype).name)
    state = jax.tree_util.tree_map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    return model(token_ids, positions, cache, metadata, logits_indices, impl=attention_impl,
                 interpret=interpret, attention=attention, options=attention_options,
                 sparse=sparse, row_queries=row_queries, kv_groups=kv_groups)


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, *, std: float = 0.02) -> dict:
    """Random parameters (normal(0, std) matrices, unit norm weights, zero biases) for tests and benchmarks.

    Args:
      config: the model's hyper-parameters.
      key: a PRNG key.
      dtype: parameter dtype.
      std: standard deviation of the matrices.

    Returns:
      Nested dict of arrays shaped like ``param_shapes(config, dtype)``.
    """
    shapes = param_shapes(config, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))

    def init(path, leaf, k):
        name = str(path[-1].key)
        if name == "weight":     # RMSNorm
            return jnp.ones(leaf.shape, dtype)
        if name.endswith("_bias"):
            return jnp.zeros(leaf.shape, dtype)
        return (std * jax.random.normal(k, leaf.shape, jnp.float32)).astype(dtype)

    return jax.tree_util.tree_unflatten(
        treedef, [init(path, leaf, k) for (path, leaf), k in zip(leaves, keys)])


def _hf_layer_map(c: ModelConfig, i: int) -> dict[str | tuple, tuple[tuple, Any]]:
    """HF tensor name (or names) -> (params path, converter from the HF [out, in] arrays)."""
    if c.mla:                                   # DeepSeek (jaxkv/model/deepseek.py)
        return deepseek.hf_layer_map(c, i)
    E, Hq, Hkv, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    p = f"model.layers.{i}."
    a = ("layers", i, "self_attn")
    m = {
        p + "self_attn.q_proj.weight": (a + ("q_proj",), lambda w: w.T.reshape(E, Hq, D)),
        p + "self_attn.k_proj.weight": (a + ("k_proj",), lambda w: w.T.reshape(E, Hkv, D)),
        p + "self_attn.v_proj.weight": (a + ("v_proj",), lambda w: w.T.reshape(E, Hkv, D)),
        p + "self_attn.o_proj.weight": (a + ("o_proj",), lambda w: w.T.reshape(Hq, D, E)),
        p + "mlp.gate_proj.weight": (("layers", i, "mlp", "gate_proj"), lambda w: w.T),
        p + "mlp.up_proj.weight": (("layers", i, "mlp", "up_proj"), lambda w: w.T),
        p + "mlp.down_proj.weight": (("layers", i, "mlp", "down_proj"), lambda w: w.T),
        p + "input_layernorm.weight": (("layers", i, "input_layernorm", "weight"), lambda w: w),
        p + "post_attention_layernorm.weight":
            (("layers", i, "post_attention_layernorm", "weight"), lambda w: w),
    }
    if c.gemma:
        for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            m[p + f"{n}.weight"] = (("layers", i, n, "weight"), lambda w: w)
    if c.is_moe_layer(i):
        m = {k: v for k, v in m.items() if ".mlp." not in k} | _hf_moe_map(c, i)
    if c.qk_norm:
        for n in ("q_norm", "k_norm"):
            m[p + f"self_attn.{n}.weight"] = (a + (n, "weight"), lambda w: w)
    if c.attention_sinks:
        m[p + "self_attn.sinks"] = (a + ("sinks",), lambda s: s)
        m[p + "self_attn.o_proj.bias"] = (a + ("o_bias",), lambda b: b)
    if c.attention_bias:
        m[p + "self_attn.q_proj.bias"] = (a + ("q_bias",), lambda b: b.reshape(Hq, D))
        m[p + "self_attn.k_proj.bias"] = (a + ("k_bias",), lambda b: b.reshape(Hkv, D))
        m[p + "self_attn.v_proj.bias"] = (a + ("v_bias",), lambda b: b.reshape(Hkv, D))
    return m


def _hf_moe_map(c: ModelConfig, i: int) -> dict[str | tuple, tuple[tuple, Any]]:
    """HF names of layer i's router and experts -> (params path, converter); each projection's
    X per-expert [out, in] matrices (a tuple of names) are stacked into [X, in, out]."""
    names = ARCHITECTURES[c.architecture].moe
    p, a = f"model.layers.{i}.{names.block}.", ("layers", i, "mlp")
    m = {p + f"{names.router}.weight": (a + ("router",), lambda w: w.T)}
    if names.gpt_oss:
        return m | _hf_gpt_oss_experts(p, a)
    for ours, theirs in (("gate_proj", names.gate), ("up_proj", names.up),
                         ("down_proj", names.down)):
        names_e = tuple(f"{p}experts.{e}.{theirs}.weight" for e in range(c.num_experts))
        m[names_e] = (a + (ours,), lambda *ws: np.stack([w.T for w in ws]))
    return m


def _hf_gpt_oss_experts(p: str, a: tuple) -> dict[str, tuple[tuple, Any]]:
    """gpt-oss's router bias and experts, stored [X, in, out] whole: the gate and up columns
    of ``gate_up_proj`` (and its bias) interleaved, gate first (a 1-tuple key names the same
    tensor a second time); kept MXFP4, the same columns are a stack's rows."""
    e = p + "experts."
    return {
        p + "router.bias": (a + ("router_bias",), lambda b: b),
        e + "gate_up_proj": (a + ("gate_proj",), lambda w: _every_other_column(w, 0)),
        (e + "gate_up_proj",): (a + ("up_proj",), lambda w: _every_other_column(w, 1)),
        e + "gate_up_proj_bias": (a + ("gate_bias",), lambda b: b[..., ::2]),
        (e + "gate_up_proj_bias",): (a + ("up_bias",), lambda b: b[..., 1::2]),
        e + "down_proj": (a + ("down_proj",), lambda w: w),
        e + "down_proj_bias": (a + ("down_bias",), lambda b: b),
    }


def _every_other_column(w, first: int):
    """Columns ``first``, ``first + 2``, ... of experts [X, in, out]: float, or a stack of
    quantized experts (whose stored rows are the columns)."""
    if isinstance(w, QuantizedWeight):
        x, k, n = w.shape
        return dataclasses.replace(w.map_rows(lambda r: r[:, first::2]), shape=(x, k, n // 2))
    return w[..., first::2]


def params_from_hf(config: ModelConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32, *,
                   source: str = "checkpoint") -> dict:
    """Converts HF-named tensors (torch Linear orientation [out, in]) into the params dict.

    Args:
      config: the model's hyper-parameters.
      tensors: HF transformers state-dict names -> numpy arrays.
      dtype: parameter dtype.
      source: the file the tensors came from, for error messages.

    Returns:
      Nested dict of jax arrays shaped like ``param_shapes(config, dtype)``.
    """
    mapping = {"model.embed_tokens.weight": (("embed_tokens",), lambda w: w),
               "model.norm.weight": (("norm", "weight"), lambda w: w)}
    if not config.tie_word_embeddings:
        mapping["lm_head.weight"] = (("lm_head",), lambda w: w.T)
    for i in range(config.num_layers):
        mapping.update(_hf_layer_map(config, i))
    shapes = param_shapes(config, dtype)
    params: dict = {}
    for name, (path, convert) in mapping.items():
        names = name if isinstance(name, tuple) else (name,)     # a tuple: stacked experts
        for n in names:
            if n not in tensors:
                raise ValueError(f"{source}: tensor {n!r} is missing")
        want = functools.reduce(lambda d, k: d[k], path, shapes).shape
        node = params
        for k in path[:-1]:
            node = node.setdefault(k, {})
        if isinstance(tensors[names[0]], QuantizedWeight):
            ws = [tensors[n] for n in names]
            if ws[0].stacked:                   # stored as one stack: converted as stored
                ws = [convert(*ws)]
            node[path[-1]] = _quantized_param(ws, path, want, names[0], source)
            continue
        value = np.asarray(convert(*(np.asarray(tensors[n]) for n in names)))
        if value.shape != want:
            raise ValueError(f"{source}: tensor {names[0]!r} has shape "
                             f"{np.shape(tensors[names[0]])}, which does not convert to {want}")
        node[path[-1]] = jnp.asarray(value, dtype)
    return params


def _quantized_param(ws: list[QuantizedWeight], path: tuple, want: tuple, name: str,
                     source: str) -> QuantizedWeight:
    """A weight kept quantized, stored [out, in], as the param of shape ``want``: the embedding
    [V, E] as stored, a linear weight read as [in..., out...] (``linear.linear``), X experts
    (several names) stacked as [X, in, out] (``quantized.stack``), or stored as a stack."""
    w = ws[0] if len(ws) == 1 else stack(ws)
    q = dataclasses.replace(w, shape=tuple(want))
    if w.stacked:
        ok = want == w.shape
    elif path == ("embed_tokens",):
        ok = want == (w.rows, w.cols)
    else:
        try:
            ok = bool(q.out_shape())
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"{source}: quantized tensor {name!r} [{w.rows}, {w.cols}] does not "
                         f"convert to {want}")
    return to_device(w, want)
