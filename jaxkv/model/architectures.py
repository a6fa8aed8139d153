"""What sets each supported architecture apart in the one shared decoder (jaxkv/model/llama.py):
a small description per HF ``model_type``, read by the config and the loaders (HF names and
llama.cpp's GGUF names to the decoder's parameters)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One HF ``model_type`` as the shared decoder runs it.

    Attributes:
      model_type: HF ``config.json``'s ``model_type``.
      gguf: llama.cpp's ``general.architecture`` for it, or None (no GGUF support); Mixtral's
        is ``llama`` (a file with ``llama.expert_count``).
      attention_bias: q/k/v projections carry a bias when ``config.json`` does not say.
      qk_norm: an RMSNorm over head_dim on each q and k head before RoPE
        (``self_attn.{q,k}_norm``; Qwen3).
      window: when ``config.json``'s ``sliding_window`` applies: ``"always"`` (Mistral),
        ``"use_sliding_window"`` (only when that flag is set: Qwen2, Qwen3), ``"layer_types"``
        (in the layers ``layer_types`` names sliding: Gemma 2 and 3) or None.
      layer_period: without ``layer_types`` in ``config.json``, every ``layer_period``-th
        layer is a full one, the others slide (Gemma 2: 2; Gemma 3: 6, or its
        ``sliding_window_pattern``).
      gemma: Gemma's decoder: RMSNorm scaled by ``1 + w``, embeddings scaled by
        ``sqrt(hidden_size)``, a norm after attention and around the MLP, GELU (tanh) SwiGLU,
        ``query_pre_attn_scalar`` and the logit soft-caps.
      gguf_permuted_qk: llama.cpp's converter permuted the q/k rows (``gguf.unpermute_qk``).
      gguf_norm_shift: llama.cpp's converter stored every ``*norm.weight`` plus this (Gemma: 1,
        its ``1 + w`` norms written as llama.cpp's plain ``w``); the GGUF loader subtracts it.
      gguf_local_rope_theta: the sliding layers' RoPE base llama.cpp assumes when the file has
        no ``{arch}.rope.freq_base_swa`` (Gemma 3: 10000), or None: theirs is the global one.
      gguf_wide_scale_layers: llama.cpp scales a GGUF's attention by ``(hidden / heads) ** -0.5``
        for the model with this many layers (Gemma 2 and 3 27B), else by ``key_length ** -0.5``.
      gguf_norm_topk_prob: the router renormalises its top-k weights in llama.cpp (Qwen3-MoE
        always) where the architecture's own ``norm_topk_prob`` does not say.
      gguf_yarn_truncate: YaRN's ramp rounds its bounds (HF's ``truncate``) for a GGUF, which
        does not record it (gpt-oss: False, as its config.json).
      moe: the names of a mixture-of-experts layer's tensors, or None (dense only).
      norm_topk_prob: the router renormalises its top-k weights always (True: Mixtral), or
        as ``config.json``'s ``norm_topk_prob`` says (None: Qwen3-MoE, default false).
      attention_sinks: a learned sink logit per query head joins each softmax
        (``self_attn.sinks``; gpt-oss), and o_proj has a bias.
      mla: DeepSeek's decoder: multi-head latent attention over a latent cache
        (jaxkv/model/mla.py) and, past ``first_k_dense_replace``, routed + shared experts
        (jaxkv/model/deepseek.py).
      router_scoring: how the router scores experts: ``"softmax"`` or ``"sigmoid"``
        (DeepSeek-V3, with ``e_score_correction_bias``); ``ModelConfig.router_scoring``.
    """

    model_type: str
    gguf: str | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    window: str | None = None
    gguf_permuted_qk: bool = False
    layer_period: int = 2
    gemma: bool = False
    moe: MoeNames | None = None
    norm_topk_prob: bool | None = None
    attention_sinks: bool = False
    gguf_norm_shift: float = 0.0
    gguf_local_rope_theta: float | None = None
    gguf_wide_scale_layers: int | None = None
    gguf_norm_topk_prob: bool = False
    gguf_yarn_truncate: bool = True
    mla: bool = False
    router_scoring: str = "softmax"


@dataclasses.dataclass(frozen=True)
class MoeNames:
    """HF tensor names of an MoE layer under ``model.layers.{i}.{block}.``: the router
    ``{router}.weight`` [X, E] and expert e's ``experts.{e}.{gate|up|down}.weight``; or, with
    ``gpt_oss``, gpt-oss's experts: the router with a bias, top-k of its logits softmaxed,
    every expert in one tensor per projection (``experts.gate_up_proj`` [X, E, 2F] with gate
    and up columns interleaved, ``experts.down_proj`` [X, F, E], and their ``_bias``), and
    the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    block: str
    router: str
    gate: str = ""
    up: str = ""
    down: str = ""
    gpt_oss: bool = False


ARCHITECTURES = {a.model_type: a for a in (
    Architecture("llama", gguf="llama", gguf_permuted_qk=True),
    Architecture("mistral", window="always"),
    Architecture("qwen2", gguf="qwen2", attention_bias=True, window="use_sliding_window"),
    Architecture("qwen3", gguf="qwen3", qk_norm=True, window="use_sliding_window"),
    Architecture("gemma2", gguf="gemma2", window="layer_types", gemma=True, gguf_norm_shift=1.0,
                 gguf_wide_scale_layers=46),
    Architecture("gemma3_text", gguf="gemma3", window="layer_types", layer_period=6, gemma=True,
                 qk_norm=True, gguf_norm_shift=1.0, gguf_local_rope_theta=10000.0,
                 gguf_wide_scale_layers=62),
    Architecture("mixtral", gguf="llama", gguf_permuted_qk=True, window="always",
                 moe=MoeNames("block_sparse_moe", "gate", "w1", "w3", "w2"), norm_topk_prob=True),
    Architecture("qwen3_moe", gguf="qwen3moe", qk_norm=True, window="use_sliding_window",
                 moe=MoeNames("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
                 gguf_norm_topk_prob=True),
    Architecture("gpt_oss", gguf="gpt-oss", attention_bias=True, window="layer_types",
                 attention_sinks=True, moe=MoeNames("mlp", "router", gpt_oss=True),
                 gguf_yarn_truncate=False),
    Architecture("deepseek_v2", mla=True, norm_topk_prob=False,
                 moe=MoeNames("mlp", "gate", "gate_proj", "up_proj", "down_proj")),
    Architecture("deepseek_v3", mla=True, router_scoring="sigmoid",
                 moe=MoeNames("mlp", "gate", "gate_proj", "up_proj", "down_proj")),
)}
# llama.cpp's ``general.architecture`` and whether the file has experts (``{arch}.expert_count``)
# -> the architecture: Mixtral is written as ``llama`` with experts.
GGUF_ARCHITECTURES = {(a.gguf, a.moe is not None): a for a in ARCHITECTURES.values() if a.gguf}

