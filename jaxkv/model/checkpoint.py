"""Params checkpoints: a params pytree as an orbax checkpoint, the ModelConfig as JSON beside it.

Layout of a checkpoint directory::

    <path>/
      params/        orbax StandardCheckpointer output (one array per leaf, tensorstore)
      jaxkv.json     {"config": ModelConfig fields or null, "metadata": caller's dict}
      tokenizer.json, tokenizer_config.json, generation_config.json   (``convert`` only: the
                     tokenizer in HF layout, read back by ``read_tokenizer``)

Restoring takes optional target shardings, so a tensor-parallel model can read each device's
shard straight from disk instead of materializing full arrays on one device first.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxkv.model.config import ModelConfig, RopeScaling
from jaxkv.model.llama import params_from_hf
from jaxkv.model.tokenizer import Tokenizer
from jaxkv.model.weights import load_model_files

PARAMS_DIR = "params"
METADATA_FILE = "jaxkv.json"


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
        and dtypes to restore into (casting if the dtype differs from the stored one).
      shardings: optional pytree of ``jax.sharding.Sharding`` (same structure as the params);
        each leaf is restored directly into that sharding. Without it and without ``target``,
        leaves come back as saved (numpy leaves as numpy, jax leaves on their saved devices).

    Returns:
      The params pytree.

    Raises:
      FileNotFoundError: no checkpoint at ``path``.
    """
    path = Path(path).absolute()
    if not (path / PARAMS_DIR).is_dir():
        raise FileNotFoundError(f"{path / PARAMS_DIR}: no params checkpoint found")
    with ocp.StandardCheckpointer() as ckptr:
        if target is None and shardings is not None:
            target = ckptr.metadata(path / PARAMS_DIR).item_metadata.tree
        if shardings is not None:
            target = jax.tree.map(
                lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s), target, shardings)
        return ckptr.restore(path / PARAMS_DIR, target)


def is_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a directory written by ``save_params`` / ``convert``."""
    path = Path(path)
    return (path / PARAMS_DIR).is_dir() and (path / METADATA_FILE).is_file()


def convert(model: str | Path, path: str | Path, *, dtype: str = "float32",
            overwrite: bool = False) -> Path:
    """Converts model files (GGUF, HF safetensors dir or store name) once into a checkpoint.

    The checkpoint holds the params dict (``jaxkv.model.llama`` layout, in ``dtype``), the
    config and the tokenizer, so ``LLM(path, tensor_parallel_size=N)`` restores each device's
    shards straight from disk without reading the source model again.

    Returns:
      The checkpoint directory.
    """
    loaded = load_model_files(model)
    params = params_from_hf(loaded.config, loaded.tensors, jnp.dtype(dtype), source=loaded.source)
    save_params(path, params, {"source": loaded.source, "dtype": dtype}, config=loaded.config,
                overwrite=overwrite)
    write_tokenizer(path, loaded.tokenizer)
    return Path(path)


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
