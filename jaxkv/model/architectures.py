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
      gguf: llama.cpp's ``general.architecture`` for it, or None (no GGUF support).
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
      moe: the names of a mixture-of-experts layer's tensors, or None (dense only).
      norm_topk_prob: the router renormalises its top-k weights always (True: Mixtral), or
        as ``config.json``'s ``norm_topk_prob`` says (None: Qwen3-MoE, default false).
      attention_sinks: a learned sink logit per query head joins each softmax
        (``self_attn.sinks``; gpt-oss), and o_proj has a bias.
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
    Architecture("gemma2", window="layer_types", gemma=True),
    Architecture("gemma3_text", window="layer_types", layer_period=6, gemma=True, qk_norm=True),
    Architecture("mixtral", window="always",
                 moe=MoeNames("block_sparse_moe", "gate", "w1", "w3", "w2"), norm_topk_prob=True),
    Architecture("qwen3_moe", qk_norm=True, window="use_sliding_window",
                 moe=MoeNames("mlp", "gate", "gate_proj", "up_proj", "down_proj")),
    Architecture("gpt_oss", attention_bias=True, window="layer_types", attention_sinks=True,
                 moe=MoeNames("mlp", "router", gpt_oss=True)),
)}
GGUF_ARCHITECTURES = {a.gguf: a for a in ARCHITECTURES.values() if a.gguf}

