"""GGUF files (llama.cpp's format): metadata -> ModelConfig, tensors -> HF-named float32 numpy.

Architectures, by llama.cpp's ``general.architecture``: ``llama`` (and Mixtral: ``llama`` with
``llama.expert_count``), ``qwen2``, ``qwen3``, ``qwen3moe``, ``gemma2``, ``gemma3`` (text) and
``gpt-oss``, with the ``{arch}.*`` metadata keys llama.cpp's ``convert_hf_to_gguf.py`` writes
and llama.cpp's own assumptions where the file is silent (Gemma 3's layer pattern and local
RoPE base, Gemma's attention scale, Qwen3-MoE's renormalised router: the ``gguf_*`` fields of
``Architecture``). Tensors of every type the ``gguf`` package's numpy reference decodes (F32,
F16, BF16, Q8_0, Q4_0/1, Q5_0/1, the K-quants Q2_K..Q6_K, MXFP4, the IQ types) are
dequantized to float32 at load, except with ``keep_quantized``: the dense layers' and the
embedding's / head's Q8_0, Q4_0, Q4_1 and MXFP4 tensors (and Mixtral's and Qwen3-MoE's experts,
gpt-oss's MXFP4 ones) then stay in their blocks, and Q4_K's and Q6_K's are repacked bit-exactly
as Q4_1 / Q8_0 codes with float32 scales (``jaxkv.model.quantized``).

GGUF stores a linear layer ``[out, in]`` with ``shape = [in, out]`` (ggml's ``ne0`` first); the
reader hands back numpy arrays already in ``[out, in]`` row-major order. ``gguf_names`` maps the
names and undoes the converter's reshaping (q/k row permutation of Llama and Mixtral, Gemma's
``w + 1`` norms, stacked experts).
"""

from __future__ import annotations

import functools
import re
import struct
from pathlib import Path

import gguf
import numpy as np

from jaxkv.model import gguf_names, quantize, quantized
from jaxkv.model.architectures import GGUF_ARCHITECTURES, Architecture
from jaxkv.model.config import LAYER_TYPES, ModelConfig, RopeScaling

SUPPORTED_GGUF_ARCHITECTURES = tuple(dict.fromkeys(name for name, _ in GGUF_ARCHITECTURES))
# F32, F16 and every type the gguf package's numpy reference decodes (a class of gguf.quants).
SUPPORTED_QUANT_TYPES = tuple(sorted(
    (q for q in gguf.GGMLQuantizationType if q.name in ("F32", "F16")
     or isinstance(getattr(gguf.quants, q.name, None), type)),
    key=lambda q: (q.name not in ("F32", "F16", "BF16"), q.value)))
hf_name = gguf_names.hf_name
unpermute_qk = gguf_names.unpermute_qk


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
    name = metadata_field(reader, "general.architecture")
    key = lambda k, default=KeyError: metadata_field(reader, f"{name}.{k}", default)  # noqa: E731
    arch = GGUF_ARCHITECTURES.get((name, int(key("expert_count", 0)) > 0))
    if arch is None:
        raise ValueError(f"{file}: general.architecture={name!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{file}: {name}.rope.dimension_count={rope_dim} != head_dim={head_dim}; "
                         "partial rotary embeddings are not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else key("vocab_size")
    eos = [metadata_field(reader, f"tokenizer.ggml.{k}", None) for k in ("eos_token_id", "eot_token_id")]
    bos = metadata_field(reader, "tokenizer.ggml.bos_token_id", None)
    tensors = {t.name for t in reader.tensors}
    return ModelConfig(
        architecture=arch.model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=arch.qk_norm,
        attention_sinks=arch.attention_sinks,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
        **_rope_fields(key, arch, file, "rope_freqs.weight" in tensors),
        **_window_fields(key, arch),
        **_gemma_fields(key, arch, hidden, heads, head_dim),
        **_moe_fields(key, arch),
    )


def _rope_fields(key, arch: Architecture, file: str, rope_freqs: bool) -> dict:
    """``rope_theta``, ``rope_scaling`` (none, linear: Gemma 3's global layers, or YaRN:
    gpt-oss) and ``rope_local_theta`` from ``{arch}.rope.*``; ``key(suffix, default)`` reads
    ``{arch}.{suffix}``. Llama 3's ``rope_freqs`` tensor is not supported."""
    kind = key("rope.scaling.type", "none")
    if kind not in ("none", "linear", "yarn") or rope_freqs:
        raise ValueError(f"{file}: RoPE scaling (rope.scaling.type={kind!r} or a rope_freqs "
                         "tensor) is not supported for GGUF; supported: none, linear, yarn")
    scaling = None if kind == "none" else RopeScaling(
        rope_type=kind, factor=float(key("rope.scaling.factor")),
        original_max_position_embeddings=int(key("rope.scaling.original_context_length", 8192)),
        beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
        truncate=arch.gguf_yarn_truncate)
    local = key("rope.freq_base_swa", arch.gguf_local_rope_theta)
    return dict(rope_theta=float(key("rope.freq_base", 10000.0)), rope_scaling=scaling,
                rope_local_theta=None if local is None else float(local))


def _window_fields(key, arch: Architecture) -> dict:
    """``sliding_window`` and ``layer_types`` of an architecture that mixes sliding and full
    layers (``window == "layer_types"``) from ``{arch}.attention.sliding_window`` and
    ``attention.sliding_window_pattern`` (per layer: sliding) or llama.cpp's fixed period
    (``Architecture.layer_period``: layer i is full when ``(i + 1) % period == 0``)."""
    window = int(key("attention.sliding_window", 0))
    if not window or arch.window != "layer_types":   # llama.cpp reads no other windows
        return {}
    n = int(key("block_count"))
    pattern = key("attention.sliding_window_pattern", None)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern or arch.layer_period)
        sliding = [(i + 1) % period != 0 for i in range(n)]
    return dict(sliding_window=window, layer_types=tuple(LAYER_TYPES[not s] for s in sliding))


def _gemma_fields(key, arch: Architecture, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma's fields: the soft-caps, and llama.cpp's attention scale (``key_length``, but
    ``hidden / heads`` for the 27B models: ``Architecture.gguf_wide_scale_layers``)."""
    if not arch.gemma:
        return {}
    caps = {k: float(key(k, 0.0)) or None
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    wide = int(key("block_count")) == arch.gguf_wide_scale_layers
    return dict(gemma=True, query_pre_attn_scalar=float(hidden // heads if wide else head_dim),
                **caps)


def _moe_fields(key, arch: Architecture) -> dict:
    """An MoE architecture's ``{arch}.expert_*`` fields (every layer an MoE one, as llama.cpp
    runs Mixtral, Qwen3-MoE and gpt-oss); gpt-oss's clamped SwiGLU at llama.cpp's limit 7."""
    if arch.moe is None:
        return {}
    norm = arch.norm_topk_prob if arch.norm_topk_prob is not None else arch.gguf_norm_topk_prob
    size = key("expert_feed_forward_length", None)
    return dict(num_experts=int(key("expert_count")),
                num_experts_per_tok=int(key("expert_used_count")),
                moe_intermediate_size=None if size is None else int(size),
                norm_topk_prob=bool(key("expert_weights_norm", norm)),
                **(dict(swiglu_limit=7.0) if arch.moe.gpt_oss else {}))


# The tensors kept in their blocks with ``keep_quantized``: the dense layers' projections, the
# embedding and the head, and a mixture's stacked experts where each expert is a matrix of its
# own (Mixtral, Qwen3-MoE: ``quantize.experts_quantized``) or in MXFP4 (gpt-oss's as its GGUFs
# ship them; in other types its experts, and the routers, are dequantized).
_KEPT_NAMES = re.compile(r"(token_embd|output)\.weight|blk\.\d+\.(attn_[qkv]|attn_output|"
                         r"ffn_gate|ffn_up|ffn_down)\.weight")
_KEPT_EXPERTS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight")


def kept_quantized(name: str, qtype: gguf.GGMLQuantizationType, config: ModelConfig) -> bool:
    """Whether ``tensors_from_gguf(keep_quantized=True)`` keeps a tensor of ``config``'s model
    in its blocks."""
    if qtype.name not in quantized.KEPT_TYPES:
        return False
    return _KEPT_NAMES.fullmatch(name) is not None or (
        _KEPT_EXPERTS.fullmatch(name) is not None
        and (quantize.experts_quantized(config) or qtype.name == "MXFP4"))


def tensors_from_gguf(reader: gguf.GGUFReader, config: ModelConfig, *,
                      keep_quantized: bool = False) -> dict[str, np.ndarray]:
    """Every tensor under its HF name, as ``gguf_names.hf_tensors`` undoes llama.cpp's
    converter (q/k rows, Gemma's ``w + 1`` norms, stacked experts): dequantized to float32,
    or with ``keep_quantized`` the ``kept_quantized`` ones as numpy ``QuantizedWeight`` (a
    stack of experts as one per expert).

    Args:
      reader: an open ``gguf.GGUFReader``.
      config: the file's config (``config_from_gguf``), for the head counts.
      keep_quantized: keep the dense weights' Q8_0 / Q4_0 / Q4_1 blocks as stored (Q4_K's
        and Q6_K's repacked).

    Returns:
      ``{hf_name: float32 array or QuantizedWeight}`` in torch ``Linear`` orientation
      (``[out, in]``).

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
    for t in reader.tensors:
        if keep_quantized and kept_quantized(t.name, t.tensor_type, config):
            if t.data.ndim == 3:                            # experts [X, out, in bytes]
                out[t.name] = [quantized.from_gguf(e, t.tensor_type.name) for e in t.data]
            else:
                out[t.name] = quantized.from_gguf(t.data, t.tensor_type.name)   # copies
            continue
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists ne0 (the fastest axis) first
        # np.array copies, so no result aliases the file's memory map.
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        out[t.name] = w.reshape(shape)
    return gguf_names.hf_tensors(out, config)


def stored_bytes(reader: gguf.GGUFReader, config: ModelConfig,
                 dtype_bytes: int) -> tuple[int, tuple[str, ...]]:
    """(bytes of the params of ``tensors_from_gguf(keep_quantized=True)`` with every float
    tensor in a dtype of ``dtype_bytes``, the kept block types): the GGUF's own bytes for
    each kept tensor (the K-quants' repacked, ``quantized.kept_bytes``)."""
    total, kept = 0, {}
    for t in reader.tensors:
        if kept_quantized(t.name, t.tensor_type, config):
            total += quantized.kept_bytes(t.tensor_type.name, int(t.n_bytes), int(t.n_elements))
            kept[t.tensor_type.name] = None
        else:
            total += int(t.n_elements) * dtype_bytes
    return total, tuple(kept)
