"""The KV-format registry and ``KVCacheSpec``: the one place a KV format is named and described.

Design notes: docs/kv-cache.md."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How one KV element type is stored.

    Attributes:
      name: the canonical ``kv_cache_dtype`` name.
      bits: stored bits per element.
      storage: numpy dtype name of the stored array (``uint8`` for packed sub-byte codes).
      quantized: codes with a scale (fp8, int8, int4, int2), not plain floats.
      kivi: the KIVI layout (int4/int2): asymmetric min/max codes with bf16 scales and zero
        points, keys per channel over a block's tokens, values per group of channels per token,
        unsealed blocks in a full-precision residual pool.
      qmax: largest representable magnitude (symmetric) or code (KIVI, ``2^bits - 1``); 0 for
        plain floats.
      metadata_bytes: quantization metadata per K or V vector of one token and one kv head: the
        bf16 per-token scale of fp8/int8; 0 for floats; KIVI statistics are per block
        (``KVCacheSpec.block_bytes``).
      supports_static_scale: one fixed per-tensor scale may replace the per-token scales (fp8).
    """

    name: str
    bits: int
    storage: str
    quantized: bool = False
    kivi: bool = False
    qmax: float = 0.0
    metadata_bytes: int = 0
    supports_static_scale: bool = False

    @property
    def per_byte(self) -> int:
        """Elements per stored byte (2 for int4, 4 for int2, else 1)."""
        return 8 // self.bits if self.bits < 8 else 1

    def vector_bytes(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) vector of one kv head: ``ceil(D bits / 8) + metadata``."""
        return -(-head_dim * self.bits // 8) + self.metadata_bytes


# Every KV format, canonical name -> format; the order is the planner's and the CLI's listing.
KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("fp32", 32, "float32"),
    KVFormat("bf16", 16, "bfloat16"),
    KVFormat("fp16", 16, "float16"),
    KVFormat("fp8_e4m3", 8, "float8_e4m3fn", quantized=True, qmax=448.0, metadata_bytes=2,
             supports_static_scale=True),
    KVFormat("fp8_e5m2", 8, "float8_e5m2", quantized=True, qmax=57344.0, metadata_bytes=2,
             supports_static_scale=True),
    KVFormat("int8", 8, "int8", quantized=True, qmax=127.0, metadata_bytes=2),
    KVFormat("int4", 4, "uint8", quantized=True, kivi=True, qmax=15.0),
    KVFormat("int2", 2, "uint8", quantized=True, kivi=True, qmax=3.0),
)}
# Model (weight and activation) dtypes: the storage of the float formats.
MODEL_DTYPES: tuple[str, ...] = tuple(f.storage for f in KV_FORMATS.values() if not f.quantized)
# Alias -> canonical name: a model dtype names the float format storing it.
KV_ALIASES: dict[str, str] = {**{f.storage: f.name for f in KV_FORMATS.values() if not f.quantized},
                              "fp8": "fp8_e4m3"}
# Storage of quantization scales and zero points.
SCALE_STORAGE = KV_FORMATS["bf16"].storage
# KIVI's value group G: the default group is the largest divisor of head_dim up to this.
KIVI_MAX_GROUP_SIZE = 32
# Formats a latent (MLA) cache holds: the floats, and fp8 with one scale per token over the
# whole latent [c_kv | k_rope] (docs/kv-cache.md, "The latent cache").
LATENT_FORMATS: tuple[str, ...] = tuple(f.name for f in KV_FORMATS.values()
                                        if not f.quantized or f.storage.startswith("float8"))
AXES = ("channel", "token")
LAYOUTS = ("nhd", "hnd")   # float pools: [N, bs, Hkv, D] or [N, Hkv, bs, D] (KVCacheSpec.layout)
_ITEMSIZE = {"int32": 4, "bool": 1, "uint8": 1,
             **{f.storage: f.bits // 8 for f in KV_FORMATS.values() if f.bits >= 8}}


def get_format(name: str) -> KVFormat:
    """The ``KVFormat`` of a canonical name or alias.

    Raises:
      ValueError: for ``"auto"`` (it needs the model dtype: ``resolve_kv_cache_dtype``) and for
        an unknown name, listing the choices.
    """
    if name == "auto":
        raise ValueError("kv_cache_dtype='auto' needs the model dtype: use resolve_kv_cache_dtype")
    canonical = KV_ALIASES.get(name, name) if isinstance(name, str) else name
    if canonical not in KV_FORMATS:
        choices = ", ".join(["auto", *KV_FORMATS, *KV_ALIASES])
        raise ValueError(f"kv_cache_dtype={name!r} is not one of: {choices}")
    return KV_FORMATS[canonical]


def check_model_dtype(dtype: str) -> None:
    """Raises ValueError naming ``dtype`` unless it is one of ``MODEL_DTYPES``."""
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of: {', '.join(MODEL_DTYPES)}")


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """Canonical KV format name: ``"auto"`` follows the model ``dtype``; aliases are mapped.

    Raises:
      ValueError: naming ``dtype``, or ``kv_cache_dtype`` with the list of choices.
    """
    check_model_dtype(dtype)
    if kv_cache_dtype == "auto":
        return KV_ALIASES[dtype]
    return get_format(kv_cache_dtype).name


def default_group_size(head_dim: int) -> int:
    """KIVI's default value group: the largest divisor of ``head_dim`` that is <= 32
    (32 for head_dim 64, 96, 128, 256; 20 for 40 and 80)."""
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim={head_dim!r} must be an int >= 1")
    return max(g for g in range(1, min(KIVI_MAX_GROUP_SIZE, head_dim) + 1) if head_dim % g == 0)


def kivi_residual_slots(max_num_seqs: int, residual_blocks: int, num_groups: int = 1) -> int:
    """Residual slots an engine allocates: every running sequence's window of
    ``residual_blocks`` blocks in each of its ``num_groups`` block tables (a hybrid cache's
    groups share the pool slots), plus one spare so a step never steals a live slot."""
    return residual_blocks * max_num_seqs * num_groups + 1


Arrays = dict[str, tuple[tuple[int, ...], str]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Everything that fixes a paged KV cache's arrays; validated (and normalized) on creation.

    Attributes:
      num_layers, block_size, num_kv_heads, head_dim: pool geometry (``num_kv_heads`` as the
        devices hold them in total: repeated kv heads under tensor parallelism included).
      num_blocks: blocks per pool including the reserved null block 0 (>= 2).
      dtype: the model (activation) dtype, one of ``MODEL_DTYPES``; the KIVI residual's dtype.
      kv_cache_dtype: a format name, alias or ``"auto"`` (= ``dtype``); stored canonical.
      group_size: channels per KIVI value group (int4/int2); None: ``default_group_size``.
        Must divide head_dim.
      residual_blocks: KIVI residual window R >= 1 in blocks: the unsealed block plus the last
        R - 1 sealed blocks of each sequence are read in full precision.
      num_residual_slots: blocks the KIVI residual pool holds, >= ``residual_blocks``; None: one
        sequence's window (``kivi_residual_slots(1, residual_blocks)``).
      key_axis, value_axis: KIVI grouping of K and V: ``"channel"`` (per channel over a block's
        tokens) or ``"token"`` (groups of ``group_size`` channels per token). KIVI is keys per
        channel, values per token (the defaults); the others are ablations.
      residual_full_precision: False reads unsealed KIVI blocks fake-quantized (the residual-off
        ablation; the storage is the same).
      static_scale: a fixed per-tensor scale instead of per-token scales (formats with
        ``supports_static_scale``: fp8), or None.
      key_bounds: keep Quest's per-block key bounds beside every K pool (``bounds_arrays``;
        nothing for KIVI formats, whose scale/zero give the bounds).
      layout: how a float pool lies in memory (``LAYOUTS``): ``"nhd"`` [num_blocks, block_size,
        num_kv_heads, head_dim] (what the Pallas kernels read) or ``"hnd"`` [num_blocks,
        num_kv_heads, block_size, head_dim], where a gathered block is already in the order
        the CPU path's batched dots read it (bench/experiments/kv_layout.py). Quantized pools are NHD.
      v_head_dim: channels of a V pool; None: ``head_dim``; 0: no values (a latent cache, MLA:
        each token's one "head" ``[c_kv | k_rope]`` lives in the K pool and is its own value,
        jaxkv/attention/mla.py; the V pools are zero-width, so every walk over K and V pools
        holds). ``LATENT_FORMATS`` only: the floats and fp8 (per-token scale).

    Raises:
      ValueError: naming the field, for any value the cache cannot be built with.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    group_size: int | None = None
    residual_blocks: int = 1
    num_residual_slots: int | None = None
    key_axis: str = "channel"
    value_axis: str = "token"
    residual_full_precision: bool = True
    static_scale: float | None = None
    key_bounds: bool = False
    layout: str = "nhd"
    v_head_dim: int | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim",
                     "residual_blocks"):
            _check_int(name, getattr(self, name))
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 2 (block 0 is the "
                             f"reserved null block)")
        check_model_dtype(self.dtype)
        fmt = get_format(resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype))
        object.__setattr__(self, "kv_cache_dtype", fmt.name)
        if self.group_size is None:
            object.__setattr__(self, "group_size", default_group_size(self.head_dim))
        _check_int("group_size", self.group_size)
        if self.num_residual_slots is None:
            object.__setattr__(self, "num_residual_slots",
                               kivi_residual_slots(1, self.residual_blocks))
        _check_int("num_residual_slots", self.num_residual_slots)
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in AXES:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {AXES}")
        if self.static_scale is not None:
            if not fmt.supports_static_scale:
                static = [f.name for f in KV_FORMATS.values() if f.supports_static_scale]
                raise ValueError(f"static_scale applies to {static}, not kv_cache_dtype="
                                 f"{fmt.name!r}")
            scale = self.static_scale
            if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
                raise ValueError(f"static_scale={scale!r} must be a finite float > 0")
        if self.layout not in LAYOUTS:
            raise ValueError(f"kv_layout={self.layout!r} is not one of {LAYOUTS}")
        if self.layout != "nhd" and fmt.quantized:
            raise ValueError(f"kv_layout={self.layout!r} holds float pools only; "
                             f"kv_cache_dtype={fmt.name!r} pools are 'nhd'")
        if self.head_dim % fmt.per_byte:
            raise ValueError(f"head_dim={self.head_dim} must be a multiple of {fmt.per_byte} for "
                             f"kv_cache_dtype={fmt.name!r} ({fmt.per_byte} codes per byte)")
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.v_head_dim not in (0, self.head_dim):
            raise ValueError(f"v_head_dim={self.v_head_dim!r} must be head_dim={self.head_dim} "
                             f"or 0 (a latent cache)")
        if self.v_head_dim == 0 and fmt.name not in LATENT_FORMATS:
            raise ValueError(f"kv_cache_dtype={fmt.name!r}: a latent (MLA) cache holds "
                             f"{', '.join(LATENT_FORMATS)} or 'auto' (int8 and KIVI's int4/int2 "
                             f"are not served for it)")
        if fmt.kivi:
            if self.head_dim % self.group_size:
                raise ValueError(f"group_size={self.group_size} must divide head_dim="
                                 f"{self.head_dim} for kv_cache_dtype={fmt.name!r}")
            if self.block_size < 2:
                raise ValueError(f"block_size={self.block_size} must be >= 2 for kv_cache_dtype="
                                 f"{fmt.name!r} (KIVI keys group the tokens of a block)")
            if self.num_residual_slots < self.residual_blocks:
                raise ValueError(f"num_residual_slots={self.num_residual_slots} must be >= "
                                 f"residual_blocks={self.residual_blocks} (one sequence's window)")

    @property
    def format(self) -> KVFormat:
        """The ``KVFormat`` of ``kv_cache_dtype``."""
        return KV_FORMATS[self.kv_cache_dtype]

    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        """Logical (unpacked) shape of every pool:
        [num_blocks, block_size, num_kv_heads, head_dim]."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def axes(self) -> tuple[str, str]:
        """(K, V) grouping: ``(key_axis, value_axis)`` for KIVI, per token for fp8/int8."""
        return (self.key_axis, self.value_axis) if self.format.kivi else ("token", "token")

    @property
    def token_group_size(self) -> int:
        """Channels per scale of a per-token pool: ``group_size`` (KIVI) or head_dim (fp8/int8,
        one scale per token and head)."""
        return self.group_size if self.format.kivi else self.head_dim

    def block_arrays(self, axis: str, value: bool = False) -> Arrays:
        """The arrays with a leading ``num_blocks`` axis of one layer's K (``axis`` =
        ``axes[0]``) or V pool (``value``, ``axis = axes[1]``): name -> (shape, numpy dtype
        name); see the module docstring."""
        fmt, (n, bs, h, d) = self.format, self.pool_shape
        if value:
            d = self.v_head_dim
        if self.layout == "hnd":
            return {"data": ((n, h, bs, d), fmt.storage)}
        out = {"data": ((n, bs, h, d // fmt.per_byte), fmt.storage)}
        if not fmt.quantized or self.static_scale is not None:
            return out
        stats = (n, 1, h, d) if axis == "channel" else (n, bs, h, d // self.token_group_size)
        out["scale"] = (stats, SCALE_STORAGE)
        if fmt.kivi:
            out.update(zero=(stats, SCALE_STORAGE), res_slot=((n,), "int32"), sealed=((n,), "bool"))
        return out

    def residual_arrays(self) -> Arrays:
        """The KIVI residual pool of one layer's K or V pool (empty for other formats)."""
        if not self.format.kivi:
            return {}
        r = self.num_residual_slots + 1                  # slot 0 is the null slot
        return {"residual": ((r, self.block_size, self.num_kv_heads, self.head_dim), self.dtype),
                "res_owner": ((r,), "int32"), "res_stamp": ((r,), "int32"),
                "clock": ((), "int32")}

    def bounds_arrays(self) -> Arrays:
        """Quest's key bounds of one layer (``kmin``, ``kmax``): kept with ``key_bounds`` for a
        float, fp8 or int8 format; empty otherwise (KIVI derives them from its statistics)."""
        if not self.key_bounds or self.format.kivi:
            return {}
        shape = (self.num_blocks, self.num_kv_heads, self.head_dim)
        return {"kmin": (shape, "float32"), "kmax": (shape, "float32")}

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V (codes, scales, zero points, per-block
        residual index and sealed flag, Quest key bounds)."""
        arrays = [a for value, axis in enumerate(self.axes)
                  for a in self.block_arrays(axis, bool(value)).values()]
        arrays += list(self.bounds_arrays().values())
        return self.num_layers * sum(_nbytes(shape[1:], dt) for shape, dt in arrays)

    @property
    def residual_bytes(self) -> int:
        """Bytes of the KIVI residual pools over all layers, K and V (0 for other formats)."""
        arrays = self.residual_arrays().values()
        return 2 * self.num_layers * sum(_nbytes(shape, dt) for shape, dt in arrays)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache: ``num_blocks x block_bytes + residual_bytes``."""
        return self.num_blocks * self.block_bytes + self.residual_bytes


def _check_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * _ITEMSIZE[dtype]
