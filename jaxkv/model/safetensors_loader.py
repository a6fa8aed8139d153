"""HF model directories: ``config.json`` -> ModelConfig, ``*.safetensors`` -> float32 numpy
(an MXFP4 checkpoint's packed experts and a compressed-tensors checkpoint's codes kept quantized
or de-quantized: jaxkv/model/mxfp4.py, jaxkv/model/compressed_tensors.py).

The safetensors layout is small enough to read directly, which lets bf16 through (safetensors'
numpy API rejects it) and lets every corruption error name the file and the tensor::

    [u64 little-endian N][N bytes of JSON header][data]
    header: {"<name>": {"dtype": "BF16", "shape": [out, in], "data_offsets": [begin, end]}, ...,
             "__metadata__": {...}}            offsets are relative to the start of data
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxkv.model import compressed_tensors, mxfp4
from jaxkv.model.config import ModelConfig

SAFETENSORS_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    # kept as stored: an MXFP4 checkpoint's blocks and scales, compressed-tensors' codes
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
FLOAT_DTYPES = ("F32", "F16", "BF16")       # read as float32
# config.json's quantization_config.quant_method
QUANT_METHODS = (None, "mxfp4", compressed_tensors.METHOD)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_hf_config(path: str | Path) -> ModelConfig:
    """Reads ``<path>/config.json`` into a ModelConfig.

    Raises:
      FileNotFoundError: no ``config.json``.
      ValueError: invalid JSON, unsupported ``model_type`` or a missing field (named).
    """
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found (an HF model directory needs config.json)")
    cfg = _read_json(file)
    _quant_method(cfg, file)
    return ModelConfig.from_hf_dict(cfg, source=str(file))


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON: {e}") from e


def _quant_method(cfg: dict, file: Path) -> str | None:
    """``quantization_config.quant_method`` of a config.json: one of ``QUANT_METHODS``, else a
    ValueError naming the field."""
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(f"{file}: quantization_config.quant_method={method!r} is not "
                         f"supported; supported: {', '.join(map(str, QUANT_METHODS))}")
    return method


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of an HF directory: the shards of ``model.safetensors.index.json``, else
    ``model.safetensors``.

    Raises:
      FileNotFoundError: neither file exists, or a shard named by the index is missing.
      ValueError: the index is not valid JSON or lacks ``weight_map``.
    """
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{index}: not a valid index (needs a 'weight_map' object): {e}") from e
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: shard listed in {index.name} not found")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def read_safetensors(file: str | Path) -> dict[str, np.ndarray]:
    """Reads one safetensors file, converting every F32 / F16 / BF16 tensor to float32.

    Args:
      file: path to a ``.safetensors`` file with tensors of ``SAFETENSORS_DTYPES``.

    Returns:
      ``{name: array}`` with the stored shapes: float32, or the others as stored.

    Raises:
      ValueError: truncated/corrupt header or data, or a dtype outside ``SAFETENSORS_DTYPES``
        (the message names the file and the tensor).
    """
    file = Path(file)
    raw = file.read_bytes()
    if len(raw) < 8:
        raise ValueError(f"{file}: corrupt safetensors file ({len(raw)} bytes, no header length)")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if 8 + header_len > len(raw):
        raise ValueError(f"{file}: corrupt safetensors file (header length {header_len} exceeds "
                         f"file size {len(raw)})")
    try:
        header = json.loads(raw[8:8 + header_len])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: corrupt safetensors header: {e}") from e
    data = memoryview(raw)[8 + header_len:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{file}: corrupt header entry for tensor {name!r}: {info!r}") from e
        if dtype_name not in SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {dtype_name}, which is not "
                             f"supported; supported: {', '.join(SAFETENSORS_DTYPES)}")
        dtype = SAFETENSORS_DTYPES[dtype_name]
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not 0 <= begin <= end <= len(data) or end - begin != expected:
            raise ValueError(f"{file}: corrupt data for tensor {name!r}: offsets [{begin}, {end}) "
                             f"for {expected} bytes of {dtype_name}{list(shape)} in a "
                             f"{len(data)}-byte data section")
        w = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
        out[name] = w.astype(np.float32) if dtype_name in FLOAT_DTYPES else w.copy()
    return out


def read_hf_tensors(path: str | Path, *, keep_quantized: bool = False) -> dict[str, np.ndarray]:
    """Reads all weight files of an HF directory (single or sharded) as float32.

    Args:
      keep_quantized: a compressed-tensors checkpoint's dense projections and an MXFP4
        checkpoint's experts as ``QuantizedWeight`` (else, as a compressed-tensors checkpoint's
        other quantized Linears, float32).

    Returns:
      ``{hf_name: float32 array}``, exactly the stored names and shapes; an MXFP4 checkpoint's
      ``W_blocks`` / ``W_scales`` pairs as the ``W`` they encode (``mxfp4.convert_checkpoint``);
      a compressed-tensors checkpoint's Linear parts as ``P.weight``
      (``compressed_tensors.convert``).
    """
    out, sources = {}, {}
    for file in safetensors_files(path):
        tensors = read_safetensors(file)
        out.update(tensors)
        sources.update(dict.fromkeys(tensors, str(file)))
    config = Path(path) / "config.json"
    cfg = _read_json(config) if config.is_file() else {}
    method = _quant_method(cfg, config)
    if method == "mxfp4":
        out = mxfp4.convert_checkpoint(out, str(path), keep_quantized)
    if method == compressed_tensors.METHOD:
        out = compressed_tensors.convert(out, sources, cfg["quantization_config"], str(config),
                                         keep_quantized)
    return out
