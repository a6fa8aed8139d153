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
        ``"use_sliding_window"`` (only when that flag is set: Qwen2, Qwen3) or None.
      gguf_permuted_qk: llama.cpp's converter permuted the q/k rows (``gguf.unpermute_qk``).
    """

    model_type: str
    gguf: str | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    window: str | None = None
    gguf_permuted_qk: bool = False


ARCHITECTURES = {a.model_type: a for a in (
    Architecture("llama", gguf="llama", gguf_permuted_qk=True),
    Architecture("mistral", window="always"),
    Architecture("qwen2", gguf="qwen2", attention_bias=True, window="use_sliding_window"),
    Architecture("qwen3", gguf="qwen3", qk_norm=True, window="use_sliding_window"),
)}
GGUF_ARCHITECTURES = {a.gguf: a for a in ARCHITECTURES.values() if a.gguf}

