"""ModelConfig: the architecture hyper-parameters every loader produces and the model consumes.

Loaders (GGUF, HF safetensors) translate their own metadata into this one frozen dataclass, so
the model never looks at file formats. Field names follow HF transformers' ``config.json``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxkv.model.architectures import ARCHITECTURES

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
LAYER_TYPES = ("sliding_attention", "full_attention")
ROUTER_SCORINGS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3's (``rope_type == "llama3"``), ``"linear"`` (every
    frequency divided by ``factor``: Gemma 3's global layers) or ``"yarn"`` (gpt-oss).

    Attributes mirror HF's ``rope_scaling`` dict: ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``; YaRN's ``beta_fast``,
    ``beta_slow``, ``truncate`` and ``attention_factor`` (None: ``0.1 ln(factor) + 1``, or
    DeepSeek's ``mscale(mscale) / mscale(mscale_all_dim)`` when both are set, with
    ``mscale(m) = 0.1 m ln(factor) + 1``; ``mscale_all_dim`` also scales MLA's softmax).
    """

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear", "yarn"):
            raise ValueError(f"rope_scaling.rope_type={self.rope_type!r} is not supported; "
                             f"supported: 'llama3', 'linear', 'yarn'")


@dataclasses.dataclass(frozen=True)
class MLA:
    """Multi-head latent attention's shapes (DeepSeek-V2/V3; jaxkv/model/mla.py).

    Attributes:
      kv_lora_rank: the latent ``c_kv``'s width ``Lkv`` (512), the values of the cache.
      qk_rope_head_dim: the one shared rotary key's width ``R`` (64).
      qk_nope_head_dim: a query/key head's unrotated width ``P`` (128).
      v_head_dim: a value head's width ``V`` (128).
      q_lora_rank: the query's low-rank width ``Lq`` (V3: 1536), or None: one q projection
        (V2-Lite).
      rope_interleave: the checkpoint's rotary pairs are ``(2i, 2i + 1)`` (V2 always, V3 by
        ``rope_interleave``); the loader reorders them into rotate-half's halves.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        """Values one token caches per layer: ``Lkv + R`` (576 for V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3,
    and the mixtures of experts Mixtral and Qwen3-MoE).

    Attributes:
      architecture: one of ``SUPPORTED_ARCHITECTURES``.
      vocab_size: rows of the embedding table.
      hidden_size: model width ``E``.
      intermediate_size: SwiGLU width ``F``.
      num_layers: decoder layers ``L``.
      num_heads: query heads ``Hq``.
      num_kv_heads: key/value heads ``Hkv`` (GQA when ``Hkv < Hq``; ``Hq % Hkv == 0``).
      head_dim: per-head width ``D``.
      rms_norm_eps: epsilon of every RMSNorm.
      rope_theta: RoPE base.
      rope_scaling: optional frequency scaling (of the full-attention layers, where
        ``rope_local_theta`` is set).
      rope_local_theta: the sliding-window layers' own RoPE base (Gemma 3), or None: theirs
        is the full layers' rotation.
      max_position_embeddings: the model's trained context length.
      tie_word_embeddings: LM head reuses the embedding table.
      draft_vocab_size: columns of an untied LM head that scores a subset of the vocabulary (a
        draft model's reduced head, jaxkv/spec_decode/draft_model.py, which maps its columns back
        to token ids), or None: every token (``vocab_size``).
      attention_bias: q/k/v projections carry a bias (Qwen2).
      qk_norm: each q and k head is RMS-normalised over head_dim before RoPE (Qwen3).
      num_experts: experts ``X`` of each MoE layer (jaxkv/model/moe.py); 0: a dense model.
      num_experts_per_tok: experts ``k`` each token is routed to (``1 <= k <= X``).
      moe_intermediate_size: an expert's SwiGLU width (default ``intermediate_size``).
      norm_topk_prob: the router renormalises the top-k weights to sum to 1.
      dense_layers: layers of an MoE model whose feed-forward is the dense MLP (Qwen3-MoE's
        ``mlp_only_layers`` and ``decoder_sparse_step``).
      swiglu_limit, swiglu_alpha: gpt-oss's experts (``MoeNames.gpt_oss``: biased router
        and experts, top-k logits softmaxed, the clamped SwiGLU); None: the others'.
      attention_sinks: a learned sink logit per query head in each softmax, and an o_proj
        bias (gpt-oss).
      sliding_window: attend to the last ``sliding_window`` positions (itself included), or None.
      layer_types: per layer ``"sliding_attention"`` (the window) or ``"full_attention"``, for a
        model that mixes them (Gemma 2); empty: every layer as ``sliding_window`` says.
      gemma: Gemma's decoder (``Architecture.gemma``): ``1 + w`` norms, scaled embeddings,
        sandwich norms, GELU (tanh) MLP.
      query_pre_attn_scalar: the attention scale is ``query_pre_attn_scalar ** -0.5`` (Gemma);
        None: ``head_dim ** -0.5``.
      attn_logit_softcapping, final_logit_softcapping: logits become ``c * tanh(x / c)`` in
        the attention and at the LM head (Gemma 2); None: no cap.
      mla: multi-head latent attention's shapes (DeepSeek), or None. With it the cache is
        latent: ``num_kv_heads`` = 1 and ``head_dim`` = ``mla.latent_dim`` describe the one
        cached "head", and RoPE turns ``mla.qk_rope_head_dim`` channels (``rope_dim``).
      num_shared_experts: DeepSeek's shared experts, one SwiGLU of width
        ``num_shared_experts x expert_size`` every token runs beside its routed experts.
      router_scoring: ``"softmax"`` (the others, DeepSeek-V2) or ``"sigmoid"`` (DeepSeek-V3:
        sigmoid scores, chosen with a learned bias, ``e_score_correction_bias``).
      num_expert_groups, topk_groups: DeepSeek's group-limited routing: the experts in
        ``num_expert_groups`` groups, a token's top-k taken from its best ``topk_groups``.
      routed_scaling_factor: the routed experts' weights are multiplied by it (DeepSeek).
      bos_token_id / eos_token_ids: special tokens (several eos ids are allowed).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_local_theta: float | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    gemma: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    draft_vocab_size: int | None = None
    mla: MLA | None = None
    num_shared_experts: int = 0
    router_scoring: str = "softmax"
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 or None")
        if self.layer_types and (len(self.layer_types) != self.num_layers or not set(
                self.layer_types) <= set(LAYER_TYPES) or self.sliding_window is None):
            raise ValueError(f"layer_types={self.layer_types} must name one of {LAYER_TYPES} "
                             f"for each of num_layers={self.num_layers}, with a sliding_window")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.num_experts < 0 or (self.moe_intermediate_size or 1) < 1:
            raise ValueError(f"num_experts={self.num_experts} must be >= 0 and "
                             f"moe_intermediate_size={self.moe_intermediate_size} >= 1")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers={self.dense_layers} must be layer indices in "
                             f"[0, num_layers={self.num_layers})")
        if self.mla and (self.num_kv_heads, self.head_dim) != (1, self.mla.latent_dim):
            raise ValueError(f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}: an MLA "
                             f"model caches one latent head of {self.mla.latent_dim}")
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router_scoring={self.router_scoring!r} is not one of "
                             f"{ROUTER_SCORINGS}")
        if self.num_experts and (self.num_experts % self.num_expert_groups
                                 or not 1 <= self.topk_groups <= self.num_expert_groups):
            raise ValueError(f"n_group={self.num_expert_groups} must divide num_experts="
                             f"{self.num_experts}, topk_group={self.topk_groups} in [1, n_group]")
        if self.draft_vocab_size is not None and (
                self.tie_word_embeddings or not 1 <= self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} needs an untied LM head "
                             f"and 1 <= draft_vocab_size <= vocab_size={self.vocab_size}")

    @property
    def rope_dim(self) -> int:
        """Channels RoPE turns: ``head_dim``, or MLA's ``qk_rope_head_dim``."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_cache_v_dim(self) -> int:
        """A V pool's channels (``KVCacheSpec.v_head_dim``): ``head_dim``, or 0 for a latent
        (MLA) cache, whose values live in its K pool."""
        return 0 if self.mla else self.head_dim

    @property
    def num_logits(self) -> int:
        """The LM head's width ``V``: ``draft_vocab_size`` or ``vocab_size``."""
        return self.draft_vocab_size or self.vocab_size

    def layer_window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window (None: full attention)."""
        if self.layer_types and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i``'s feed-forward is the mixture of experts (else the dense MLP)."""
        return self.num_experts > 0 and i not in self.dense_layers

    @property
    def expert_size(self) -> int:
        """An expert's SwiGLU width ``F``."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Build from an HF ``config.json`` dict; ``source`` names the file in error messages."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: model_type={model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            arch = ARCHITECTURES[model_type]
            window, layer_types = _layer_windows(cfg, arch, source)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            fields = dict(
                architecture=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                **_rope_fields(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch.attention_bias)),
                qk_norm=arch.qk_norm,
                attention_sinks=arch.attention_sinks,
                layer_types=layer_types,
                **_gemma_fields(cfg, arch, head_dim),
                **_moe_fields(cfg, arch),
                sliding_window=int(window) if window else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
            return cls(**(fields | _deepseek_fields(cfg, arch, source)))
        except KeyError as e:
            raise ValueError(f"{source}: required field {e.args[0]!r} is missing") from None


def _layer_windows(cfg: dict[str, Any], arch,
                   source: str) -> tuple[int | None, tuple[str, ...]]:
    """(the sliding window, ModelConfig's ``layer_types``): the window of every layer and no
    types, None when no layer has one, or with ``Architecture.window == "layer_types"``
    (Gemma) the window and the types when they mix sliding and full layers.

    ``layer_types``, where ``config.json`` has it, says it per layer. Raises ValueError if the
    layers mix kinds and the architecture cannot.
    """
    rule, types = arch.window, tuple(cfg.get("layer_types") or ())
    n, window = int(cfg["num_hidden_layers"]), cfg.get("sliding_window")
    if rule == "layer_types" and not types:          # every period-th layer full
        period = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                     or arch.layer_period)
        types = tuple(LAYER_TYPES[(i + 1) % period == 0] for i in range(n))
    if rule == "layer_types" and len(set(types)) > 1:
        return int(window), types
    first = n                                       # layers from ``first`` on slide
    if rule == "always" and window:
        first = 0
    elif rule == "use_sliding_window" and cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers") or 0)     # Qwen2/Qwen3's rule
    sliding = {i >= first for i in range(n)}
    if types:
        sliding = {t == "sliding_attention" for t in types}
    if len(sliding) > 1:
        raise ValueError(f"{source}: layer_types={cfg.get('layer_types')}, max_window_layers="
                         f"{cfg.get('max_window_layers')}: a model that mixes sliding-window and "
                         f"full-attention layers is not supported yet; supported: one kind in "
                         f"every layer")
    return (int(window) if sliding == {True} and window else None), ()


def _moe_fields(cfg: dict[str, Any], arch) -> dict[str, Any]:
    """ModelConfig's MoE fields from an MoE architecture's ``config.json`` (none if dense)."""
    if arch.moe is None:
        return {}
    n = int(cfg["num_hidden_layers"])
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ()) | set(    # DeepSeek: the first k dense
        range(int(cfg.get("first_k_dense_replace") or 0)))
    normalize = arch.norm_topk_prob
    return dict(
        num_experts=int(cfg.get("num_experts") or cfg.get("n_routed_experts")
                        or cfg["num_local_experts"]),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"])
        if cfg.get("moe_intermediate_size") else None,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False) if normalize is None
                            else normalize),
        dense_layers=tuple(i for i in range(n) if i in only or (i + 1) % step),
        **(dict(swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702))) if arch.moe.gpt_oss else {}))


def _deepseek_fields(cfg: dict[str, Any], arch, source: str) -> dict[str, Any]:
    """ModelConfig's MLA and DeepSeek-MoE fields from a DeepSeek ``config.json`` (none for other
    families): the latent cache's one head, the shared experts, the router's scoring, groups
    and scale (``topk_method="greedy"``: one group)."""
    if not arch.mla:
        return {}
    if cfg.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=True is not supported for {arch.model_type}; "
                         f"supported: false (as every released DeepSeek checkpoint)")
    q_lora = cfg.get("q_lora_rank")
    mla = MLA(kv_lora_rank=int(cfg["kv_lora_rank"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
              qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
              q_lora_rank=int(q_lora) if q_lora else None,
              rope_interleave=bool(cfg.get("rope_interleave", True)))
    grouped = arch.router_scoring == "sigmoid" or cfg.get("topk_method") == "group_limited_greedy"
    return dict(mla=mla, num_kv_heads=1, head_dim=mla.latent_dim, attention_bias=False,
                num_shared_experts=int(cfg.get("n_shared_experts") or 0),
                router_scoring=arch.router_scoring,
                num_expert_groups=int(cfg.get("n_group") or 1) if grouped else 1,
                topk_groups=int(cfg.get("topk_group") or 1) if grouped else 1,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))


def _gemma_fields(cfg: dict[str, Any], arch, head_dim: int) -> dict[str, Any]:
    """ModelConfig's Gemma fields from a Gemma ``config.json`` (none for other families)."""
    if not arch.gemma:
        return {}
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={cfg['hidden_activation']!r} is not supported; "
                         f"supported: 'gelu_pytorch_tanh'")
    caps = {k: float(cfg[k]) if cfg.get(k) else None
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return dict(gemma=True, query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or
                                                        head_dim), **caps)


def _rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling`` and ``rope_local_theta`` of a ``config.json``: HF's
    ``rope_scaling`` / ``rope_theta``, or transformers 5's ``rope_parameters`` (one dict, or
    one per layer type: Gemma 3's full and sliding layers)."""
    params = cfg.get("rope_parameters") or {}
    local = cfg.get("rope_local_base_freq")                    # older Gemma 3 configs
    if "full_attention" in params:
        local = params.get("sliding_attention", {}).get("rope_theta", local)
        params = params["full_attention"]
    rs = cfg.get("rope_scaling") or params
    kind = rs.get("rope_type", rs.get("type")) if rs else None
    scaling = None if kind in (None, "default") else RopeScaling(
        rope_type=kind, factor=float(rs["factor"]),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
        truncate=bool(rs.get("truncate", True)),
        attention_factor=None if rs.get("attention_factor") is None
        else float(rs["attention_factor"]),
        **{k: float(rs[k]) for k in ("mscale", "mscale_all_dim") if rs.get(k)})
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    return dict(rope_theta=float(theta), rope_scaling=scaling,
                rope_local_theta=None if local is None else float(local))
