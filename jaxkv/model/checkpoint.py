"""Params checkpoints: a params pytree as an orbax checkpoint, the ModelConfig as JSON beside it.

Layout of a checkpoint directory::

    <path>/
      params/        orbax StandardCheckpointer output (one array per leaf, tensorstore; a
                     ``QuantizedWeight``'s codes, scales and minima as three)
      jaxkv.json     {"config": ModelConfig fields or null, "metadata": caller's dict,
                      "quantized": {"layers/0/attn/q_proj": {"qtype", "shape", "group",
                                    "arrays": {"qs": [shape, dtype], "d": ..., "m": ... or null}}}}
      tokenizer.json, tokenizer_config.json, generation_config.json   (``convert`` only: the
                     tokenizer in HF layout, read back by ``read_tokenizer``)

Restoring takes optional target shardings, so a tensor-parallel model can read each device's
shard straight from disk instead of materializing full arrays on one device first. Quantized
weights come back as the same ``QuantizedWeight``s (``restore_target`` rebuilds their static
fields from ``quantized``); ``convert``'s metadata says how they were made
(``read_quantization``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxkv.model import quantize
from jaxkv.model.config import ModelConfig, RopeScaling
from jaxkv.model.llama import params_from_hf
from jaxkv.model.quantization import DEFAULT_GROUP, METHODS, check_group, scale_group
from jaxkv.model.quantized import QuantizedWeight
from jaxkv.model.tokenizer import Tokenizer
from jaxkv.model.weights import load_model_files

PARAMS_DIR = "params"
METADATA_FILE = "jaxkv.json"
AS_STORED = "as stored"       # convert's default: a model file's quantized tensors kept as stored
FLOAT = "none"                # every weight dequantized (quantization="none")


def save_params(path: str | Path, params: Any, metadata: dict[str, Any] | None = None, *,
                config: ModelConfig | None = None, overwrite: bool = False) -> None:
    """Saves a params pytree (nested dicts of jax or numpy arrays, any dtype) and its metadata.

    Args:
      path: checkpoint directory (created).
      params: the pytree.
      metadata: JSON-serializable extras (e.g. the source file, a quantization recipe).
      config: the model's ModelConfig, stored as JSON and read back by ``read_config``.
      overwrite: replace an existing checkpoint at ``path``.

    Raises:
      ValueError: ``path`` already holds a checkpoint and ``overwrite`` is False, or the
        metadata is not JSON-serializable.
    """
    path = Path(path).absolute()  # orbax wants absolute paths
    if (path / PARAMS_DIR).exists() and not overwrite:
        raise ValueError(f"{path}: a checkpoint already exists (pass overwrite=True)")
    try:
        meta_text = json.dumps({
            "config": None if config is None else dataclasses.asdict(config),
            "metadata": metadata or {},
            "quantized": _quantized_leaves(params),
        }, indent=2)
    except TypeError as e:
        raise ValueError(f"{path}: metadata is not JSON-serializable: {e}") from e
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, params, force=overwrite)
        ckptr.wait_until_finished()
    (path / METADATA_FILE).write_text(meta_text, encoding="utf-8")


def restore_params(path: str | Path, target: Any = None, shardings: Any = None) -> Any:
    """Restores a params pytree saved by ``save_params``.

    Args:
      path: checkpoint directory.
      target: optional pytree of arrays or ``jax.ShapeDtypeStruct`` giving the structure, shapes
        and dtypes to restore into (casting if the dtype differs from the stored one); the
        quantized weights' places are taken by what is stored (``restore_target``).
      shardings: optional pytree of ``jax.sharding.Sharding`` (same structure as the params);
        each leaf is restored directly into that sharding. Without it and without ``target``,
        leaves come back as saved (numpy leaves as numpy, jax leaves on their saved devices;
        where some weights are quantized, every leaf as a jax array).

    Returns:
      The params pytree, quantized weights as the ``QuantizedWeight``s saved.

    Raises:
      FileNotFoundError: no checkpoint at ``path``.
    """
    path = Path(path).absolute()
    if not (path / PARAMS_DIR).is_dir():
        raise FileNotFoundError(f"{path / PARAMS_DIR}: no params checkpoint found")
    if target is not None or shardings is not None or _read(path).get("quantized"):
        target = restore_target(path, target)
    with ocp.StandardCheckpointer() as ckptr:
        if shardings is not None:
            target = jax.tree.map(
                lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s), target, shardings)
        return ckptr.restore(path / PARAMS_DIR, target)


def restore_target(path: str | Path, target: Any = None) -> Any:
    """The pytree ``restore_params`` restores into: ``target`` (default: the stored tree's
    shapes and dtypes) with each quantized weight's place taken by a ``QuantizedWeight`` of
    ``jax.ShapeDtypeStruct``s, its static fields and array dtypes as saved."""
    path = Path(path).absolute()
    if target is None:
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.metadata(path / PARAMS_DIR).item_metadata.tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
    for key, q in _read(path).get("quantized", {}).items():
        arrays = {k: None if a is None else jax.ShapeDtypeStruct(tuple(a[0]), jnp.dtype(a[1]))
                  for k, a in q["arrays"].items()}
        w = QuantizedWeight(**arrays, qtype=q["qtype"], shape=tuple(q["shape"]), group=q["group"])
        target = _replace(target, key.split("/"), w)
    return target


def _replace(tree: dict, keys: list[str], value: Any) -> dict:
    """A copy of the nested dict ``tree`` with the node at ``keys`` (str of each key) ``value``."""
    if not keys:
        return value
    k = next((k for k in tree if str(k) == keys[0]), None)
    if k is None:
        raise ValueError(f"the params have no {keys[0]!r} among {sorted(map(str, tree))}")
    return {**tree, k: _replace(tree[k], keys[1:], value)}


def _quantized_leaves(params: Any) -> dict[str, dict]:
    """``jaxkv.json``'s ``quantized``: each ``QuantizedWeight``'s key path ("a/b/c"), static
    fields and arrays' [shape, dtype]."""
    out = {}
    flat, _ = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    for kp, w in flat:
        if isinstance(w, QuantizedWeight):
            arrays = {k: None if a is None else [list(a.shape), jnp.dtype(a.dtype).name]
                      for k, a in (("qs", w.qs), ("d", w.d), ("m", w.m))}
            out[_key(kp)] = dict(qtype=w.qtype, shape=list(w.shape), group=w.group, arrays=arrays)
    return out


def is_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a directory written by ``save_params`` / ``convert``."""
    path = Path(path)
    return (path / PARAMS_DIR).is_dir() and (path / METADATA_FILE).is_file()


def convert(model: str | Path, path: str | Path, *, dtype: str = "float32",
            quantization: str | None = None, group: int = DEFAULT_GROUP,
            overwrite: bool = False) -> Path:
    """Converts model files (GGUF, HF safetensors dir or store name) once into a checkpoint.

    The checkpoint holds the params dict (``jaxkv.model.llama`` layout, float weights in
    ``dtype``), the config and the tokenizer, so ``LLM(path, tensor_parallel_size=N)`` restores
    each device's shards straight from disk without reading the source model again.

    Args:
      quantization: None (as stored: a GGUF's kept blocks and a compressed-tensors
        checkpoint's codes stay quantized, as ``LLM(model)`` keeps them), ``"none"`` (every
        weight dequantized) or one of ``quantization.METHODS`` (the dense projections and
        experts quantized as ``LLM(model, quantization=...)`` does); recorded in the metadata.
      group: int4's values per scale (``quantization_group_size``).

    Returns:
      The checkpoint directory.

    Raises:
      ValueError: naming ``quantization`` or ``quantization_group_size``, before any weight
        is read.
    """
    if quantization not in (None, FLOAT, *METHODS):
        raise ValueError(f"quantization={quantization!r}: one of None (as stored), {FLOAT!r}, "
                         f"{', '.join(map(repr, METHODS))}")
    check_group(group)
    loaded = load_model_files(model, keep_quantized=quantization is None)
    tensors = loaded.tensors
    if quantization in METHODS:
        tensors = quantize.quantize_tensors(tensors, quantization, group, loaded.source)
    params = params_from_hf(loaded.config, tensors, jnp.dtype(dtype), source=loaded.source)
    held = AS_STORED if quantization is None else quantization
    save_params(path, params, {"source": loaded.source, "dtype": dtype, "quantization": held,
                               "quantization_group_size": scale_group(held, group)},
                config=loaded.config, overwrite=overwrite)
    write_tokenizer(path, loaded.tokenizer)
    return Path(path)


def read_quantization(path: str | Path) -> tuple[str, int | None, tuple[str, ...]]:
    """(how ``convert`` made the checkpoint's weights: one of ``METHODS``, ``AS_STORED`` or
    ``FLOAT``; int4's group, else None; the stored quantized types, e.g. ("Q4_1",), empty when
    every weight is float). A checkpoint of ``save_params`` without that record counts as
    ``AS_STORED``, one with no quantized weight as ``FLOAT``."""
    data = _read(Path(path))
    kinds = tuple(dict.fromkeys(q["qtype"] for q in data.get("quantized", {}).values()))
    meta = data["metadata"]
    method = meta.get("quantization", AS_STORED if kinds else FLOAT)
    return method, meta.get("quantization_group_size"), kinds


def check_quantization(path: str | Path, method: str | None, group: int) -> None:
    """Raises ValueError naming ``quantization`` (or ``quantization_group_size``) where an
    engine asks the checkpoint at ``path`` for other weights than it holds, as vLLM refuses a
    ``quantization`` that differs from the checkpoint's: None (as stored) always reads it;
    ``"none"`` a float checkpoint; a method the checkpoint ``convert`` made with it (int4: in
    the same groups)."""
    held, held_group, kinds = read_quantization(path)
    if method is None or (method == held and (held_group is None or held_group == group)):
        return
    field = ("quantization_group_size" if method == held else "quantization")
    asked = group if method == held else repr(method)
    raise ValueError(f"{field}={asked}: {path} is an orbax checkpoint holding "
                     f"{_describe(held, held_group, kinds)}; load it with quantization=None "
                     f"(as stored) or convert the model again with jaxkv convert "
                     f"--quantization {method}")


def _describe(held: str, group: int | None, kinds: tuple[str, ...]) -> str:
    """A checkpoint's weights in words (``read_quantization``'s fields)."""
    if held in METHODS:
        return f"{held} weights" + (f" in groups of {group}" if group else "")
    return f"its source's {'/'.join(kinds)} weights as stored" if kinds else "float weights"


def stored_bytes(path: str | Path, dtype_bytes: int) -> tuple[int, str] | None:
    """(bytes of the checkpoint's params with its float leaves in a dtype of ``dtype_bytes``,
    what the quantized ones are in words), None when no weight is quantized."""
    path = Path(path).absolute()
    quantized = _read(path).get("quantized", {})
    if not quantized:
        return None
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.metadata(path / PARAMS_DIR).item_metadata.tree
    quant_keys = set(quantized)
    floats = sum(int(np.prod(x.shape)) * dtype_bytes
                 for k, x in _flat(tree).items() if k.rsplit("/", 1)[0] not in quant_keys)
    quant = sum(int(np.prod(a[0])) * jnp.dtype(a[1]).itemsize
                for q in quantized.values() for a in q["arrays"].values() if a is not None)
    return floats + quant, _describe(*read_quantization(path))


def _flat(tree: Any) -> dict[str, Any]:
    """{"a/b/c": leaf} of a nested dict."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_key(kp): x for kp, x in flat}


def _key(key_path) -> str:
    """A pytree key path as "a/b/c" (each dict key or sequence index as str)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)


def write_tokenizer(path: str | Path, tokenizer: Tokenizer) -> None:
    """Stores a tokenizer beside the params in HF layout (``tokenizer.json``,
    ``tokenizer_config.json``, ``generation_config.json``), for ``read_tokenizer``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {**tokenizer.special_tokens, "chat_template": tokenizer.chat_template}, indent=2),
        encoding="utf-8")
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": list(tokenizer.eos_token_ids), "bos_token_id": tokenizer.bos_token_id},
        indent=2), encoding="utf-8")


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer ``convert`` / ``write_tokenizer`` stored beside the params."""
    return Tokenizer.from_hf_dir(path)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The ``metadata`` dict given to ``save_params``."""
    return _read(Path(path))["metadata"]


def read_config(path: str | Path) -> ModelConfig | None:
    """The ModelConfig given to ``save_params`` (None if none was saved)."""
    cfg = _read(Path(path))["config"]
    if cfg is None:
        return None
    scaling = cfg.pop("rope_scaling")
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}   # JSON lists
    return ModelConfig(**cfg, rope_scaling=None if scaling is None else RopeScaling(**scaling))


def _read(path: Path) -> dict[str, Any]:
    file = path / METADATA_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found (not a jaxkv checkpoint)")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON: {e}") from e
