"""llama.cpp's GGUF tensor names -> jaxkv's (HF transformers') names, per architecture.

llama.cpp's ``convert_hf_to_gguf.py`` names a tensor ``blk.{i}.{stem}.{weight|bias}`` (the
``gguf`` package's ``TENSOR_NAMES``). Most stems mean the same in every architecture
(``_LAYER_NAMES``); a few differ (``_LAYER_OVERRIDES``): ``ffn_norm`` is Llama's
``post_attention_layernorm`` but Gemma's ``pre_feedforward_layernorm``, whose
``post_attention_layernorm`` is ``post_attention_norm``. The converter also reshapes a few:

* Llama and Mixtral's q/k rows are permuted for interleaved RoPE (``unpermute_qk`` undoes it).
* Gemma's norms are stored as ``w + 1`` (``Architecture.gguf_norm_shift``).
* A mixture of experts stacks its experts: ``ffn_{gate,up}_exps`` ``[X, F, E]`` and
  ``ffn_down_exps`` ``[X, E, F]`` in ``[out, in]`` order, the router is ``ffn_gate_inp``.
  Mixtral and Qwen3-MoE split them back into ``experts.{x}.*``; gpt-oss keeps HF's stacks
  (``gate_up_proj`` ``[X, E, 2F]`` with gate and up columns interleaved, ``down_proj``
  ``[X, F, E]``, both transposed from GGUF's) and its biases ``ffn_*_exps.bias``.
"""

from __future__ import annotations

import re

import numpy as np

from jaxkv.model import quantized
from jaxkv.model.architectures import ARCHITECTURES
from jaxkv.model.config import ModelConfig
from jaxkv.model.quantized import QuantizedWeight

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_OVERRIDES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3_text": _GEMMA_NAMES,
    "gpt_oss": {"post_attention_norm": "post_attention_layernorm"},
}
# Tensors whose HF name has no .weight suffix: gpt-oss's per-head sink logits.
_BARE_NAMES = {"attn_sinks.weight": "self_attn.sinks"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")


def layer_names(architecture: str) -> dict[str, str]:
    """GGUF layer stem -> HF name under ``model.layers.{i}.`` for one architecture (its router
    ``ffn_gate_inp`` included; the stacked experts are ``split_experts``')."""
    names = _LAYER_NAMES | _LAYER_OVERRIDES.get(architecture, {})
    moe = ARCHITECTURES[architecture].moe
    if moe is not None:
        names = names | {"ffn_gate_inp": f"{moe.block}.{moe.router}"}
    return names


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """HF transformers name of a (non-expert) GGUF tensor name, e.g. ``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
      ValueError: a name the architecture's GGUF does not have (listing the supported names).
    """
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    names = layer_names(architecture)
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is not None and f"{m[2]}.{m[3]}" in _BARE_NAMES and ARCHITECTURES[
            architecture].attention_sinks:
        return f"model.layers.{m[1]}.{_BARE_NAMES[f'{m[2]}.{m[3]}']}"
    if m is None or m.group(2) not in names:
        raise ValueError(
            f"GGUF tensor {gguf_name!r} is not supported for {architecture}; supported: "
            f"{', '.join(GLOBAL_NAMES)}, blk.N.{{{','.join(names)}}}.{{weight,bias}}")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's RoPE row permutation of a q or k projection, per head of width D::

        GGUF row  h*D + 2*i + j   <-   HF row  h*D + j*D/2 + i      (i < D/2, j in {0, 1})

    Args:
      w: ``[num_heads * D, in]`` weight or ``[num_heads * D]`` bias, GGUF (interleaved) row order.
      num_heads: heads in ``w`` (``num_heads`` for q, ``num_kv_heads`` for k).

    Returns:
      Same shape and dtype, rows in HF's rotate-half order.
    """
    d = w.shape[0] // num_heads
    if d * num_heads != w.shape[0] or d % 2:
        raise ValueError(f"q/k rows {w.shape[0]} do not split into {num_heads} heads of even width")
    rest = w.shape[1:]
    return w.reshape(num_heads, d // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors (``[out, in]``) -> HF-named ones as jaxkv's loaders return
    them: renamed, q/k rows un-permuted, Gemma norms un-shifted, experts unstacked. A
    ``QuantizedWeight`` (a dense weight kept in its blocks) is renamed, its rows un-permuted.

    Raises:
      ValueError: a tensor name the architecture's GGUF does not have.
    """
    arch = ARCHITECTURES[config.architecture]
    out, experts = {}, {}
    for name, w in tensors.items():
        if arch.gguf_norm_shift and name.endswith("norm.weight"):
            w = w - np.float32(arch.gguf_norm_shift)
        m = _EXPERTS_RE.fullmatch(name)
        if m is not None and arch.moe is not None:
            experts[int(m[1]), m[2], m[3]] = w
            continue
        hf = hf_name(name, config.architecture)
        heads = (config.num_heads if ".self_attn.q_proj." in hf else
                 config.num_kv_heads if ".self_attn.k_proj." in hf else None)
        if arch.gguf_permuted_qk and heads is not None:
            w = (w.map_rows(lambda a: unpermute_qk(a, heads)) if isinstance(w, QuantizedWeight)
                 else unpermute_qk(w, heads))                   # a row permutation
        out[hf] = w
    if arch.moe is None:
        return out
    return out | (_stacked_experts if arch.moe.gpt_oss else _split_experts)(experts, config)


def _split_experts(experts: dict[tuple[int, str, str], np.ndarray],
                   config: ModelConfig) -> dict[str, np.ndarray]:
    """Mixtral / Qwen3-MoE: each stacked ``ffn_{proj}_exps.weight`` ``[X, out, in]`` (or X
    ``QuantizedWeight``s kept in their blocks) -> one ``{block}.experts.{x}.{name}.weight`` per
    expert."""
    moe = ARCHITECTURES[config.architecture].moe
    names = {"gate": moe.gate, "up": moe.up, "down": moe.down}
    out = {}
    for (layer, proj, kind), w in experts.items():
        if kind != "weight":
            raise ValueError(f"GGUF tensor 'blk.{layer}.ffn_{proj}_exps.{kind}' is not "
                             f"supported for {config.architecture}; supported: weight")
        prefix = f"model.layers.{layer}.{moe.block}.experts."
        out |= {f"{prefix}{x}.{names[proj]}.weight": w[x] for x in range(len(w))}
    return out


def _stacked_experts(experts: dict[tuple[int, str, str], np.ndarray],
                     config: ModelConfig) -> dict[str, np.ndarray]:
    """gpt-oss: ``ffn_{gate,up}_exps`` ``[X, F, E]`` (biases ``[X, F]``) -> ``gate_up_proj``
    ``[X, E, 2F]`` with gate in the even columns (bias ``[X, 2F]``); ``ffn_down_exps``
    ``[X, E, F]`` -> ``down_proj`` ``[X, F, E]`` (bias ``[X, E]`` as stored). Experts kept in
    their blocks (X ``QuantizedWeight``s each) become stacks, gate_up's rows interleaved."""
    moe = ARCHITECTURES[config.architecture].moe
    out = {}
    for layer in sorted({k[0] for k in experts}):
        p = f"model.layers.{layer}.{moe.block}.experts."

        def get(proj: str, kind: str) -> np.ndarray:
            if (layer, proj, kind) not in experts:
                raise ValueError(f"GGUF tensor 'blk.{layer}.ffn_{proj}_exps.{kind}' is missing")
            return experts[layer, proj, kind]
        gate, up = get("gate", "weight"), get("up", "weight")
        bias = np.empty((len(gate), 2 * gate[0].shape[0]), np.float32)
        bias[:, 0::2], bias[:, 1::2] = get("gate", "bias"), get("up", "bias")
        out |= {p + "gate_up_proj": _interleaved(gate, up), p + "gate_up_proj_bias": bias,
                p + "down_proj": _in_out(get("down", "weight")),
                p + "down_proj_bias": get("down", "bias")}
    return out


def _kept(w) -> bool:
    """Whether ``w`` is a GGUF's experts kept in their blocks (a list of ``QuantizedWeight``)."""
    return isinstance(w, list)


def _in_out(w):
    """Experts ``[X, out, in]`` (float, or kept: stacked, ``[X, in, out]`` being its shape)
    as ``[X, in, out]``."""
    return quantized.stack(w) if _kept(w) else np.ascontiguousarray(w.transpose(0, 2, 1))


def _interleaved(gate, up):
    """gpt-oss's ``gate_up_proj`` ``[X, E, 2F]`` of gate and up ``[X, F, E]``: gate in the even
    columns (a kept stack's rows)."""
    if _kept(gate) and _kept(up) and gate[0].qtype == up[0].qtype:
        g, u = quantized.stack(gate), quantized.stack(up)
        x, e, f = g.shape

        def rows(k):                                   # [X, 2F, ...]: gate's row, up's row, ...
            a = getattr(g, k)
            return None if a is None else np.stack([a, getattr(u, k)], axis=2).reshape(
                x, 2 * f, -1)
        return QuantizedWeight(rows("qs"), rows("d"), rows("m"), g.qtype, (x, e, 2 * f), g.group)
    gate, up = (np.stack([quantized.dequantize_numpy(e) for e in w]) if _kept(w) else w
                for w in (gate, up))
    gate_up = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.float32)
    gate_up[:, 0::2], gate_up[:, 1::2] = gate, up
    return np.ascontiguousarray(gate_up.transpose(0, 2, 1))
