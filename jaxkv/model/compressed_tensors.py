"""compressed-tensors checkpoints (llm-compressor's output, vLLM's input): each quantized
Linear's stored tensors -> a numpy ``QuantizedWeight`` in ``jaxkv.model.quantized``'s layouts.

A Linear ``P`` [O, I] of ``config.json``'s ``quantization_config`` (quant_method
"compressed-tensors") is stored by ``format`` as

    pack-quantized    P.weight_packed int32 [O, ceil(I * bits / 32)]: value + 2 ** (bits - 1),
                      element i at bits i * bits of its row, little-endian; P.weight_shape (O, I);
                      asymmetric: P.weight_zero_point int32 packed the same way along dim 0
    int-quantized     P.weight int8 [O, I] (asymmetric: P.weight_zero_point int8 as the scale)
    float-quantized   P.weight float8_e4m3fn [O, I]
    naive-quantized   either
    and P.weight_scale: tensor (1,), channel [O, 1], group [O, ceil(I / g)], block [bh, bw]
    [ceil(O / bh), ceil(I / bw)];   value = (q - zero) * scale

and becomes Q4_0 (int4 symmetric), Q4_1 (int4 asymmetric, m = -(zero + 8) * scale), Q8_0
(int8) or F8_E4M3 (fp8): per channel or tensor group K, block rows repeated per row, group bw.
Scales are stored f16: a bf16 or f16 scale converts exactly (in f16's normal range), an f32
one (and Q4_1's minimum) rounds to nearest.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import NoReturn

import ml_dtypes
import numpy as np

from jaxkv.model.quantize import quantizable
from jaxkv.model.quantized import BLOCK, QuantizedWeight, dequantize_numpy, pack_nibbles

METHOD = "compressed-tensors"
FORMATS = {"pack-quantized": ("int",), "int-quantized": ("int",),     # weights.type of each
           "float-quantized": ("float",), "naive-quantized": ("int", "float")}
STRATEGIES = ("tensor", "channel", "group", "block")
PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One config group's weights: ``field`` names it in messages."""

    targets: tuple
    format: str
    bits: int
    fp: bool                 # float8 codes (else int)
    symmetric: bool
    strategy: str
    group: int | None        # group_size (group), block width (block)
    block_rows: int          # block height (block), else 1
    field: str


def read_config(qc: dict, file: str) -> tuple[list[Scheme], list[str]]:
    """(the schemes of ``config_groups``, ``ignore``) of a ``quantization_config``.

    Raises:
      ValueError: naming the field and ``file``: a format, bit width, strategy, group or
        block the layouts cannot hold, activation ordering by group (g_idx), dynamic weights,
        output activations, a KV-cache scheme, a transform or sparsity config.
    """
    for key in ("kv_cache_scheme", "transform_config", "sparsity_config"):
        if qc.get(key):
            _refuse(file, f"quantization_config.{key}", qc[key], "is not supported")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        _refuse(file, "quantization_config.config_groups", groups, "must name schemes")
    schemes = [_scheme(g, name, qc.get("format"), file) for name, g in groups.items()]
    if any(g.get("input_activations") for g in groups.values()):
        warnings.warn(f"{file}: quantization_config's input_activations are not quantized: "
                      "jaxkv runs activations in float (weight-only)")
    return schemes, list(qc.get("ignore") or [])


def _scheme(group, name: str, top_format, file: str) -> Scheme:
    """Config group ``name``'s scheme: its format and ``_weights``."""
    field = f"quantization_config.config_groups.{name}"
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        _refuse(file, f"{field}.weights", group, "must be a weights scheme")
    if group.get("output_activations"):
        _refuse(file, f"{field}.output_activations", group["output_activations"],
                "is not supported")
    fmt = group.get("format") or top_format
    if fmt not in FORMATS:
        _refuse(file, f"{field}.format" if group.get("format") else "quantization_config.format",
                fmt, f"is not supported; supported: {', '.join(FORMATS)}")
    return _weights(group["weights"], f"{field}.weights", fmt,
                    tuple(group.get("targets") or ()), file)


def _weights(w: dict, field: str, fmt: str, targets: tuple, file: str) -> Scheme:
    """The ``weights`` arguments ``w`` checked against what the layouts hold."""
    bits, fp, strategy = w.get("num_bits"), w.get("type") == "float", w.get("strategy")
    if w.get("type") not in FORMATS[fmt]:
        _refuse(file, f"{field}.type", w.get("type"), f"is not stored {fmt}")
    if bits not in ((8,) if fp else (4, 8)):
        _refuse(file, f"{field}.num_bits", bits, f"of type {w.get('type')!r} is not supported; "
                "supported: int 4 or 8, float 8")
    if strategy not in STRATEGIES:
        _refuse(file, f"{field}.strategy", strategy, f"is not one of {', '.join(STRATEGIES)}")
    for key, ok, why in (
            ("dynamic", not w.get("dynamic"), "(weights are stored)"),
            ("actorder", w.get("actorder") in (None, False, "weight", "static"),
             "(a g_idx permutation; 'weight' and 'static' are read)"),
            ("symmetric", w.get("symmetric", True) or bits == 4 and not fp,
             "(zero points: int4 only)")):
        if not ok:
            _refuse(file, f"{field}.{key}", w.get(key), f"is not supported {why}")
    rows, cols = 1, w.get("group_size") if strategy == "group" else None
    if strategy == "block":
        rows, cols = (list(w.get("block_structure") or []) + [None, None])[:2]
    if strategy in ("group", "block") and not (isinstance(cols, int) and cols > 0
                                               and cols % BLOCK == 0 and isinstance(rows, int)):
        key = "group_size" if strategy == "group" else "block_structure"
        _refuse(file, f"{field}.{key}", w.get(key), f"must be a multiple of {BLOCK} wide")
    return Scheme(targets, fmt, bits, fp, w.get("symmetric", True), strategy, cols, rows, field)


def _refuse(file: str, field: str, value, why: str) -> NoReturn:
    raise ValueError(f"{file}: {field}={value!r} {why}")


def scheme_of(module: str, schemes: list[Scheme], ignore: list[str]) -> Scheme | None:
    """The scheme of Linear ``module`` (a name, a ``re:`` pattern, then "Linear" targets), or
    None where ``ignore`` lists it."""
    if any(_matches(module, t) for t in ignore):
        return None
    named = [s for s in schemes if any(_matches(module, t) for t in s.targets)]
    linear = [s for s in schemes if "Linear" in s.targets]
    return (named or linear or [None])[0]


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def convert(tensors: dict, sources: dict, qc: dict, config_file: str,
            keep_quantized: bool) -> dict:
    """``tensors`` (HF names -> arrays as stored) with each quantized Linear's parts replaced by
    ``P.weight``: a ``QuantizedWeight`` for a dense projection or an expert
    (``quantize.quantizable``) with ``keep_quantized``, else float32 [O, I] (its dequantized
    values); activation scales
    (``input_scale``) dropped. ``sources``: the file of each tensor, for messages.

    Raises:
      ValueError: ``read_config``'s, or a tensor that does not match its scheme, naming the
        tensor and its file.
    """
    schemes, ignore = read_config(qc, config_file)
    out = {k: v for k, v in tensors.items()
           if not k.endswith(tuple(f".{p}" for p in PARTS) + (".input_scale",))}
    for prefix in sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}):
        name, source = f"{prefix}.weight", str(sources.get(f"{prefix}.weight_scale", config_file))
        scheme = scheme_of(prefix, schemes, ignore)
        if scheme is None:
            raise ValueError(f"{source}: {prefix}.weight_scale: no config group of "
                             f"{config_file} quantizes {prefix!r}")
        w = to_quantized(prefix, tensors, scheme, source)
        out[name] = w if keep_quantized and quantizable(name) else dequantize_numpy(w)
    return out


def to_quantized(prefix: str, tensors: dict, s: Scheme, source: str) -> QuantizedWeight:
    """The numpy ``QuantizedWeight`` of Linear ``prefix``'s stored parts under scheme ``s``."""
    codes = _codes(prefix, tensors, s, source)                          # [O, I]
    n, k = codes.shape
    if k % BLOCK:
        raise ValueError(f"{source}: tensor {prefix}.weight [{n}, {k}] has K={k}, not a "
                         f"multiple of {BLOCK}")
    group = s.group or k
    scale = _per_row(tensors, f"{prefix}.weight_scale", s, (n, -(-k // group)), source)
    d = _f16(scale, f"{prefix}.weight_scale", source)
    if s.fp:
        return QuantizedWeight(codes.astype(ml_dtypes.float8_e4m3fn), d, None, "F8_E4M3",
                               (n, k), group)
    if s.bits == 8:
        return QuantizedWeight(codes.astype(np.int8), d, None, "Q8_0", (n, k), group)
    qs = pack_nibbles(codes + 8)
    if s.symmetric:
        return QuantizedWeight(qs, d, None, "Q4_0", (n, k), group)
    zero = _zero_point(prefix, tensors, s, d.shape, source) + 8                 # [O, G]
    m = _f16(-zero * d.astype(np.float32), f"{prefix}.weight_zero_point's minimum", source)
    return QuantizedWeight(qs, d, m, "Q4_1", (n, k), group)


def _codes(prefix: str, tensors: dict, s: Scheme, source: str) -> np.ndarray:
    """The signed codes int16 [O, I] (fp8: float8_e4m3fn) as stored."""
    if s.format != "pack-quantized":
        w = _part(tensors, f"{prefix}.weight", source)
        want = ml_dtypes.float8_e4m3fn if s.fp else np.int8
        if w.dtype != want or w.ndim != 2:
            raise ValueError(f"{source}: tensor {prefix}.weight is {w.dtype}{list(w.shape)}; "
                             f"{s.format} stores {np.dtype(want).name} [O, I]")
        return w if s.fp else w.astype(np.int16)
    packed = _part(tensors, f"{prefix}.weight_packed", source)
    shape = tuple(int(x) for x in _part(tensors, f"{prefix}.weight_shape", source).ravel())
    if packed.dtype != np.int32 or len(shape) != 2 or packed.shape != (
            shape[0], -(-shape[1] * s.bits // 32)):
        raise ValueError(f"{source}: tensor {prefix}.weight_packed is {packed.dtype}"
                         f"{list(packed.shape)}, not int32 packing {s.bits}-bit weight_shape "
                         f"{list(shape)}")
    return _unpack(packed, s.bits, shape[1])


def _unpack(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int16 [R, count] signed values of int32 [R, W] packed along rows (``pack_to_int32``)."""
    b = words.astype("<i4").view(np.uint8)                             # little-endian bytes
    u = b if bits == 8 else np.stack([b & 0xF, b >> 4], axis=-1).reshape(len(b), -1)
    return u[:, :count].astype(np.int16) - (1 << (bits - 1))


def _per_row(tensors: dict, name: str, s: Scheme, want: tuple, source: str) -> np.ndarray:
    """``name`` (a scale or zero point) as one entry per row and group, ``want`` [O, G]."""
    a = _part(tensors, name, source)
    n = want[0]
    stored = {"tensor": (1,), "channel": (n, 1), "group": want,
              "block": (-(-n // s.block_rows), want[1])}[s.strategy]
    if a.size != math.prod(stored) or (s.strategy != "tensor" and a.shape != stored):
        raise ValueError(f"{source}: tensor {name} has shape {list(a.shape)}; strategy "
                         f"{s.strategy!r} of [{n}, K] stores {list(stored)}")
    a = np.repeat(a, s.block_rows, axis=0)[:n] if s.strategy == "block" else a
    return np.broadcast_to(a.reshape(-1, a.shape[-1] if a.ndim == 2 else 1), want)


def _zero_point(prefix: str, tensors: dict, s: Scheme, want: tuple,
                source: str) -> np.ndarray:
    """float32 [O, G] signed zero points (pack-quantized's packed along dim 0)."""
    name = f"{prefix}.weight_zero_point"
    z = _part(tensors, name, source)
    if s.format == "pack-quantized" and s.strategy in ("group", "channel"):
        if z.dtype != np.int32 or z.shape != (-(-want[0] * s.bits // 32), want[1]):
            raise ValueError(f"{source}: tensor {name} is {z.dtype}{list(z.shape)}, not int32 "
                             f"packing {s.bits}-bit [{want[0]}, {want[1]}] along dim 0")
        z = _unpack(np.ascontiguousarray(z.T), s.bits, want[0]).T
    return _per_row({name: z}, name, s, want, source).astype(np.float32)


def _f16(a: np.ndarray, name: str, source: str) -> np.ndarray:
    """float16 ``a`` (rounded to nearest; below 2^-14 subnormal, with fewer bits); a ValueError
    naming ``name`` and ``source`` where a value overflows f16 or a nonzero one flushes to 0."""
    a = np.asarray(a, np.float32)
    with np.errstate(over="ignore"):
        out = a.astype(np.float16)
    bad = ~np.isfinite(out) | ((out == 0) & (a != 0))
    if bad.any():
        raise ValueError(f"{source}: tensor {name} holds {a[bad].flat[0]:g}, outside float16's "
                         f"range (QuantizedWeight's scales are float16)")
    return np.ascontiguousarray(out)


def _part(tensors: dict, name: str, source: str) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"{source}: tensor {name!r} is missing (compressed-tensors)")
    return np.asarray(tensors[name])


def nbytes(s: Scheme, n: int, k: int) -> int:
    """Bytes of a [n, k] Linear as ``to_quantized`` holds it."""
    groups = -(-k // (s.group or k))
    codes = n * k // 2 if s.bits == 4 else n * k
    return codes + 2 * n * groups * (1 if s.symmetric else 2)
