"""Model files -> LoadedModel: the one entry point the model and engine use to get weights.

``load_model_files`` accepts a GGUF file, an HF directory or a name from the local store
(``models/``), and always returns the same contract: a ModelConfig, float32 numpy tensors under HF
transformers' names in torch ``Linear`` orientation (``[out, in]``), q/k rows in HF's rotate-half
RoPE order, and the Tokenizer. Every tensor is checked against the shapes the config implies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxkv.model import compressed_tensors as ct
from jaxkv.model import mxfp4, safetensors_loader, store
from jaxkv.model.architectures import ARCHITECTURES
from jaxkv.model.config import ModelConfig
from jaxkv.model.quantization import BLOCK
from jaxkv.model.quantize import quantizable
from jaxkv.model.tokenizer import Tokenizer

# Buffers some HF checkpoints carry that are recomputed, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """Everything a model file provides.

    Attributes:
      config: architecture hyper-parameters.
      tensors: ``{hf_name: float32 array}``; see ``expected_shapes`` for names and shapes.
      tokenizer: the model's tokenizer and chat template.
      source: the file or directory it came from.
    """

    config: ModelConfig
    tensors: dict[str, np.ndarray]
    tokenizer: Tokenizer
    source: str


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes a checkpoint of ``config`` must hold.

    With ``V`` vocab, ``E`` hidden, ``F`` intermediate, ``Hq``/``Hkv`` heads of width ``D``:
    ``model.embed_tokens.weight [V, E]``; per layer ``i`` under ``model.layers.{i}.``:
    ``self_attn.q_proj.weight [Hq*D, E]``, ``self_attn.{k,v}_proj.weight [Hkv*D, E]``,
    ``self_attn.o_proj.weight [E, Hq*D]``, q/k/v biases ``[Hq*D]``/``[Hkv*D]`` when
    ``attention_bias``, ``mlp.{gate,up}_proj.weight [F, E]``, ``mlp.down_proj.weight [E, F]``,
    ``input_layernorm.weight [E]``, ``post_attention_layernorm.weight [E]``, and
    ``self_attn.{q,k}_norm.weight [D]`` with ``qk_norm``, Gemma's
    ``{pre,post}_feedforward_layernorm.weight [E]``, an MoE layer's router and experts
    (``_moe_shapes``) for the MLP; then
    ``model.norm.weight [E]`` and ``lm_head.weight [V, E]`` unless embeddings are tied.
    """
    if config.mla:                                 # DeepSeek's names (jaxkv/model/deepseek.py)
        from jaxkv.model.deepseek_names import expected_shapes as deepseek_shapes
        return deepseek_shapes(config)
    e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, e)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, e),
            p + "self_attn.k_proj.weight": (kv, e),
            p + "self_attn.v_proj.weight": (kv, e),
            p + "self_attn.o_proj.weight": (e, q),
            p + "mlp.gate_proj.weight": (f, e),
            p + "mlp.up_proj.weight": (f, e),
            p + "mlp.down_proj.weight": (e, f),
            p + "input_layernorm.weight": (e,),
            p + "post_attention_layernorm.weight": (e,),
        }
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config.attention_sinks:
            shapes |= {p + "self_attn.sinks": (config.num_heads,),
                       p + "self_attn.o_proj.bias": (e,)}
        if config.qk_norm:
            d = (config.head_dim,)
            shapes |= {p + "self_attn.q_norm.weight": d, p + "self_attn.k_norm.weight": d}
        if config.gemma:
            shapes |= {p + "pre_feedforward_layernorm.weight": (e,),
                       p + "post_feedforward_layernorm.weight": (e,)}
        if config.is_moe_layer(i):
            shapes = {k: v for k, v in shapes.items() if not k.startswith(p + "mlp.")}
            shapes |= _moe_shapes(config, p)
    return shapes


def row_parallel(name: str, config: ModelConfig) -> bool:
    """Whether the tensor of HF name ``name`` of ``config``'s model splits along K (its input)
    under tensor parallelism: o_proj, a dense or shared down_proj, an expert's down (Mixtral's
    w2)."""
    moe = ARCHITECTURES[config.architecture].moe
    down = (moe and moe.down) or "down_proj"
    return re.search(rf"(o_proj|down_proj|experts\.\d+\.{down})\.weight$", name) is not None


def _moe_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """An MoE layer's router [X, E] and each expert's gate/up [F, E] and down [E, F]; gpt-oss's
    router bias [X] and stacked experts (gate_up [X, E, 2F], down [X, F, E], their biases)."""
    names = ARCHITECTURES[config.architecture].moe
    e, f, p = config.hidden_size, config.expert_size, f"{prefix}{names.block}."
    x_ = config.num_experts
    shapes = {f"{p}{names.router}.weight": (x_, e)}
    if names.gpt_oss:
        return shapes | {f"{p}router.bias": (x_,), f"{p}experts.gate_up_proj": (x_, e, 2 * f),
                         f"{p}experts.gate_up_proj_bias": (x_, 2 * f),
                         f"{p}experts.down_proj": (x_, f, e),
                         f"{p}experts.down_proj_bias": (x_, e)}
    for x in range(config.num_experts):
        q = f"{p}experts.{x}."
        shapes |= {q + f"{names.gate}.weight": (f, e), q + f"{names.up}.weight": (f, e),
                   q + f"{names.down}.weight": (e, f)}
    return shapes


def check_tensors(tensors: dict[str, np.ndarray], config: ModelConfig,
                  source: str) -> dict[str, np.ndarray]:
    """Validates names and shapes against ``expected_shapes(config)``.

    Drops recomputed buffers (``rotary_emb.inv_freq``) and a redundant ``lm_head.weight`` of a
    tied model (HF ignores it too).

    Returns:
      The tensors, exactly the ``expected_shapes`` names.

    Raises:
      ValueError: a missing tensor, a wrong shape, or tensors the architecture does not have,
        naming ``source`` and the tensor.
    """
    shapes = expected_shapes(config)
    tensors = {k: w for k, w in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)
               and not (k == "lm_head.weight" and config.tie_word_embeddings)}
    missing = [k for k in shapes if k not in tensors]
    if missing:
        raise ValueError(f"{source}: tensor {missing[0]!r} is missing ({len(missing)} missing of "
                         f"the {len(shapes)} a {config.architecture} model with this config needs)")
    unexpected = sorted(set(tensors) - set(shapes))
    if unexpected:
        raise ValueError(f"{source}: unexpected tensors for architecture {config.architecture!r}: "
                         f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    for k, shape in shapes.items():
        if tensors[k].shape != shape:
            raise ValueError(f"{source}: tensor {k!r} has shape {tensors[k].shape}, "
                             f"config implies {shape}")
    return {k: tensors[k] for k in shapes}


def load_gguf(path: str | Path, *, keep_quantized: bool = False) -> LoadedModel:
    """Loads a GGUF file (the architectures and tensor types ``jaxkv.model.gguf`` lists);
    ``keep_quantized``: its dense Q8_0 / Q4_0 / Q4_1 weights as ``QuantizedWeight`` (Q4_K /
    Q6_K repacked, ``quantized.from_gguf``)."""
    from jaxkv.model import gguf  # the gguf package only when a GGUF is read
    reader = gguf.open_gguf(path)
    config = gguf.config_from_gguf(reader)
    tensors = check_tensors(gguf.tensors_from_gguf(reader, config, keep_quantized=keep_quantized),
                            config, str(path))
    return LoadedModel(config, tensors, Tokenizer.from_gguf_metadata(reader), str(path))


def load_hf_dir(path: str | Path, *, keep_quantized: bool = False) -> LoadedModel:
    """Loads an HF transformers directory (``config.json``, safetensors, ``tokenizer.json``);
    ``keep_quantized``: a compressed-tensors checkpoint's dense projections and experts as
    ``QuantizedWeight``."""
    config = safetensors_loader.read_hf_config(path)
    tensors = check_tensors(safetensors_loader.read_hf_tensors(path, keep_quantized=keep_quantized),
                            config, str(path))
    return LoadedModel(config, tensors, Tokenizer.from_hf_dir(path), str(path))


def load_model_files(path_or_name: str | Path, *, keep_quantized: bool = False) -> LoadedModel:
    """Loads a model from a GGUF file, an HF directory or a store name.

    Args:
      path_or_name: ``*.gguf`` file; directory with ``config.json``; or a name from the local
        store (e.g. ``store.DEFAULT_MODEL``, downloaded on first use).
      keep_quantized: a GGUF's dense Q8_0 / Q4_0 / Q4_1 weights (and experts) stay in their
        blocks (Q4_K / Q6_K repacked), a compressed-tensors checkpoint's dense projections and
        experts in its codes
        (``jaxkv.model.quantized.QuantizedWeight``, ``[out, in]``); no effect on float files.

    Returns:
      LoadedModel with float32 HF-named tensors (and with ``keep_quantized``, quantized ones).

    Raises:
      ValueError: unknown name / unsupported file, or any loader error (naming file and field).
      FileNotFoundError: a required file inside an HF directory is missing.
    """
    path = store.resolve(path_or_name)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, keep_quantized=keep_quantized)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_dir(path, keep_quantized=keep_quantized)
    if path.is_dir():
        raise FileNotFoundError(f"{path / 'config.json'}: not found (a model directory needs "
                                "config.json, tokenizer.json and safetensors weights)")
    raise ValueError(f"{path}: not a supported model file; supported: a *.gguf file, an HF "
                     f"directory with config.json, or a store name ({', '.join(store.names())})")


def stored_weights_bytes(path_or_name: str | Path, config: ModelConfig,
                         dtype_bytes: int) -> tuple[int, str] | None:
    """(bytes, what they are in words) of a model's params when a GGUF's dense Q8_0 / Q4_0 /
    Q4_1 weights (and experts) stay in their blocks, a compressed-tensors checkpoint's dense
    projections and experts in its codes, or an MXFP4 checkpoint's experts in theirs
    (``load_model_files(keep_quantized=True)``), and every other tensor is in a dtype of
    ``dtype_bytes``; None when nothing would stay quantized, or when ``path_or_name`` is not
    the model ``config`` was read from (no tensor is loaded)."""
    path = store.resolve(path_or_name)
    if path.is_dir() and (path / "config.json").is_file():
        return (_mxfp4_bytes(path, config, dtype_bytes)
                or _compressed_tensors_bytes(path, config, dtype_bytes))
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    from jaxkv.model import gguf
    reader = gguf.open_gguf(path)
    if gguf.config_from_gguf(reader) != config:
        return None
    total, kept = gguf.stored_bytes(reader, config, dtype_bytes)
    return (total, f"{'/'.join(kept)} blocks kept") if kept else None


MXFP4_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")   # what an MXFP4 checkpoint packs


def _quant_method(path: Path) -> str | None:
    """An HF directory's ``quantization_config.quant_method`` (None for none)."""
    qc = json.loads((path / "config.json").read_text(encoding="utf-8")).get("quantization_config")
    return (qc or {}).get("quant_method")


def is_mxfp4(path_or_name: str | Path) -> bool:
    """Whether ``path_or_name`` is an HF directory of an MXFP4 checkpoint (gpt-oss as shipped),
    whose experts alone are quantized."""
    path = store.resolve(path_or_name)
    return path.is_dir() and (path / "config.json").is_file() and _quant_method(path) == "mxfp4"


def _mxfp4_bytes(path: Path, config: ModelConfig, dtype_bytes: int) -> tuple[int, str] | None:
    """``stored_weights_bytes`` of an MXFP4 checkpoint (gpt-oss): its stacked experts at 4.25
    bits a weight (``mxfp4.nbytes``); None for any other directory or one not of ``config``."""
    if _quant_method(path) != "mxfp4" or safetensors_loader.read_hf_config(path) != config:
        return None
    total = sum(mxfp4.nbytes(shape) if name.endswith(MXFP4_EXPERTS)
                else math.prod(shape) * dtype_bytes
                for name, shape in expected_shapes(config).items())
    return total, "MXFP4 experts kept"


def _compressed_tensors_bytes(path: Path, config: ModelConfig,
                              dtype_bytes: int) -> tuple[int, str] | None:
    """``stored_weights_bytes`` of an HF directory: its config's quantized dense projections and
    experts (``compressed_tensors.scheme_of``) as ``compressed_tensors.nbytes``, None if none."""
    schemes = _kept_schemes(path, config)
    if not schemes:
        return None
    total = sum(ct.nbytes(schemes[name], *shape) if name in schemes
                else math.prod(shape) * dtype_bytes
                for name, shape in expected_shapes(config).items())
    kinds = sorted({f"{'fp' if s.fp else 'int'}{s.bits} {s.strategy}" for s in schemes.values()})
    return total, f"compressed-tensors {'/'.join(kinds)} kept"


def _kept_schemes(path: Path, config: ModelConfig) -> dict[str, ct.Scheme]:
    """{HF weight name: its scheme} of the projections and experts a compressed-tensors
    checkpoint at ``path`` keeps quantized; empty for any other directory or one not of
    ``config``."""
    file = path / "config.json"
    if _quant_method(path) != ct.METHOD or safetensors_loader.read_hf_config(path) != config:
        return {}
    qc = json.loads(file.read_text(encoding="utf-8"))["quantization_config"]
    schemes, ignore = ct.read_config(qc, str(file))
    kept = {name: quantizable(name) and ct.scheme_of(name.rsplit(".", 1)[0], schemes, ignore)
            for name in expected_shapes(config)}
    return {name: s for name, s in kept.items() if s}


def kept_k_group(path_or_name: str | Path, config: ModelConfig) -> int | None:
    """The widest scale group along K of the row-parallel projections (o_proj, down_proj, an
    expert's down) that
    ``load_model_files(keep_quantized=True)`` keeps quantized, what a tensor-parallel split of
    K must not cut: a GGUF's 32-value blocks (Q4_K and Q6_K repacked in groups of 32 and 16),
    an MXFP4 checkpoint's, a compressed-tensors checkpoint's group or block width; None for a
    scale per row, or nothing kept."""
    path = store.resolve(path_or_name)
    if path.is_file() and path.suffix == ".gguf":
        return BLOCK
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    if _quant_method(path) == "mxfp4":
        return BLOCK
    groups = [s.group for name, s in _kept_schemes(path, config).items()
              if row_parallel(name, config) and s.group]
    return max(groups, default=None)


def load_config(path_or_name: str | Path) -> ModelConfig:
    """Reads only a model's hyper-parameters (no tensors): for the memory planner.

    Args:
      path_or_name: a ``*.gguf`` file (metadata only), an HF directory, a ``config.json`` file,
        or a store name.

    Raises:
      ValueError: an unsupported file, naming it.
    """
    path = store.resolve(path_or_name)
    if path.is_file() and path.suffix == ".gguf":
        from jaxkv.model import gguf
        return gguf.config_from_gguf(gguf.open_gguf(path))
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir() and (path / "config.json").is_file():
        return safetensors_loader.read_hf_config(path)
    raise ValueError(f"{path}: not a model config; supported: a *.gguf file, an HF directory, "
                     f"a config.json file, or a store name ({', '.join(store.names())})")
