"""GGUF files (llama.cpp's format): metadata -> ModelConfig, tensors -> HF-named float32 numpy.

GGUF stores a linear layer ``[out, in]`` with ``shape = [in, out]`` (ggml's ``ne0`` first); the
reader hands back numpy arrays already in ``[out, in]`` row-major order, so only the names change.
llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of *llama* models so that RoPE
rotates interleaved pairs ``(x[2i], x[2i+1])``; HF (and jaxkv) rotate halves
``(x[i], x[i + D/2])``. ``unpermute_qk`` undoes it, per head of width ``D``::

    GGUF row  h*D + 2*i + j   <-   HF row  h*D + j*D/2 + i      (i < D/2, j in {0, 1})

Qwen2 and Qwen3 GGUFs are not permuted (their converter keeps HF's layout).
"""

from __future__ import annotations

import functools
import re
import struct
from pathlib import Path

import gguf
import numpy as np

from jaxkv.model.architectures import ARCHITECTURES, GGUF_ARCHITECTURES
from jaxkv.model.config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)
SUPPORTED_QUANT_TYPES = tuple(gguf.GGMLQuantizationType[n] for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"))

_GLOBAL_NAMES = {
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
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """HF transformers name of a GGUF tensor name, e.g. ``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
      ValueError: a name outside the Llama/Qwen2 layout (listing the supported names).
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(
            f"GGUF tensor {gguf_name!r} is not supported; supported: "
            f"{', '.join(_GLOBAL_NAMES)}, blk.N.{{{','.join(_LAYER_NAMES)}}}.{{weight,bias}}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's RoPE row permutation of a q or k projection.

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


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Opens (memory-maps) a GGUF file; the reader of an unchanged file (same size and mtime)
    is reused, so reading the config and then the weights parses the metadata once (1.6 s for
    SmolLM2's 30-layer file).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file, or truncated (naming the file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found")
    st = path.stat()
    return _open_unchanged(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_unchanged(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    """The reader of one version of a file (``size`` and ``mtime_ns`` key the version)."""
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, struct.error) as e:
        raise ValueError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e


def metadata_field(reader: gguf.GGUFReader, key: str, default=KeyError):
    """The value of GGUF metadata ``key``; ``default`` when absent, else a ValueError naming it."""
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise ValueError(f"{reader.data.filename}: GGUF metadata {key!r} is missing")
        return default
    return f.contents()


def config_from_gguf(reader: gguf.GGUFReader) -> ModelConfig:
    """Reads the ``{arch}.*`` and ``tokenizer.ggml.*`` metadata into a ModelConfig.

    Args:
      reader: an open ``gguf.GGUFReader``.

    Raises:
      ValueError: unsupported architecture, RoPE scaling or partial rotary, or missing fields
        (the message names the file and the field).
    """
    file = reader.data.filename
    arch = metadata_field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{file}: general.architecture={arch!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    scaling = metadata_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{file}: RoPE scaling ({arch}.rope.scaling.type={scaling!r} or a "
                         "rope_freqs tensor) is not supported for GGUF; supported: none")
    hidden = int(metadata_field(reader, f"{arch}.embedding_length"))
    heads = int(metadata_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(metadata_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(metadata_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{file}: {arch}.rope.dimension_count={rope_dim} != head_dim={head_dim}; "
                         "partial rotary embeddings are not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else metadata_field(reader, f"{arch}.vocab_size")
    eos = [metadata_field(reader, f"tokenizer.ggml.{k}", None) for k in ("eos_token_id", "eot_token_id")]
    bos = metadata_field(reader, "tokenizer.ggml.bos_token_id", None)
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch].model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(metadata_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(metadata_field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(metadata_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(metadata_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(metadata_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(metadata_field(reader, f"{arch}.context_length")),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        attention_bias=any(t.name == "blk.0.attn_q.bias" for t in reader.tensors),
        qk_norm=GGUF_ARCHITECTURES[arch].qk_norm,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
    )


def tensors_from_gguf(reader: gguf.GGUFReader, config: ModelConfig) -> dict[str, np.ndarray]:
    """Dequantizes every tensor to float32 under its HF name, q/k rows in HF order.

    Args:
      reader: an open ``gguf.GGUFReader``.
      config: the file's config (``config_from_gguf``), for the head counts.

    Returns:
      ``{hf_name: float32 array}`` in torch ``Linear`` orientation (``[out, in]``).

    Raises:
      ValueError: a tensor in a quantization type outside ``SUPPORTED_QUANT_TYPES`` (checked for
        all tensors before any work), or an unknown tensor name.
    """
    file = Path(reader.data.filename).name
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_QUANT_TYPES:
            raise ValueError(
                f"{file}: tensor {t.name!r} has quantization type {t.tensor_type.name}, which is "
                f"not supported; supported: {', '.join(q.name for q in SUPPORTED_QUANT_TYPES)}")
    out = {}
    permuted = ARCHITECTURES[config.architecture].gguf_permuted_qk
    for t in reader.tensors:
        name = hf_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists ne0 (the fastest axis) first
        # np.array copies, so no result aliases the file's memory map.
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(shape)
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_qk(w, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_qk(w, config.num_kv_heads)
        out[name] = w
    return out
