"""The KV-format registry and KVCacheSpec: format names live only in jaxkv/kvcache/spec.py, KIVI's
default group fits every head_dim, bad specs name their field, and init_cache allocates exactly
the arrays (shapes, dtypes, bytes) the spec and the planner count."""

import ast
import functools
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kvcache import pages as kvcache
from jaxkv.kvcache.spec import (KV_ALIASES, KV_FORMATS, MODEL_DTYPES, KVCacheSpec,
                                default_group_size, get_format, kivi_residual_slots,
                                resolve_kv_cache_dtype)
from jaxkv.model import quantize
from jaxkv.model.config import ModelConfig
from jaxkv.runner import memory_plan

PACKAGE = Path(__file__).resolve().parents[1] / "jaxkv"
REGISTRY = PACKAGE / "kvcache" / "spec.py"
# Weight quantization (``LLM(quantization=...)``) shares three of the names: its registry and
# its quantizers.
WEIGHT_MODULES = (PACKAGE / "model" / "quantization.py", PACKAGE / "model" / "quantize.py")
# The names that mean a KV format and nothing else. The model dtype names (float32, bfloat16,
# float16) are aliases too, but they also name weight and activation dtypes everywhere.
FORMAT_NAMES = set(KV_FORMATS) | {a for a in KV_ALIASES if a not in MODEL_DTYPES}

spec = functools.partial(KVCacheSpec, num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2,
                         head_dim=16)


def _string_constants(path: Path):
    """(line, value) of every str constant of a module except docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            yield node.lineno, node.value


def test_format_names_appear_only_in_the_registry():
    assert FORMAT_NAMES == {"fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4",
                            "int2", "fp8"}
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {value!r}"
             for path in sorted(PACKAGE.rglob("*.py")) if path not in (REGISTRY, *WEIGHT_MODULES)
             for line, value in _string_constants(path) if value in FORMAT_NAMES]
    assert not found, "KV format names outside jaxkv/kvcache/spec.py:\n" + "\n".join(found)
    assert {v for _, v in _string_constants(REGISTRY)} >= FORMAT_NAMES
    weight_names = {v for _, v in _string_constants(WEIGHT_MODULES[0])} & FORMAT_NAMES
    assert weight_names == {"int8", "fp8", "int4"} == set(quantize.METHODS)


def test_registry_names_and_aliases():
    assert resolve_kv_cache_dtype("auto", "bfloat16") == "bf16"
    assert resolve_kv_cache_dtype("float32", "bfloat16") == "fp32"
    assert resolve_kv_cache_dtype("fp8", "float32") == "fp8_e4m3"
    assert get_format("int4").per_byte == 2 and get_format("int2").per_byte == 4
    assert [f.name for f in KV_FORMATS.values() if f.supports_static_scale] == ["fp8_e4m3",
                                                                               "fp8_e5m2"]
    with pytest.raises(ValueError, match=r"^kv_cache_dtype='int3' is not one of: auto, fp32"):
        get_format("int3")
    with pytest.raises(ValueError, match=r"^dtype='float64'"):
        resolve_kv_cache_dtype("auto", "float64")


@pytest.mark.parametrize("head_dim,group", [(40, 20), (64, 32), (80, 20), (96, 32), (128, 32),
                                            (256, 32), (16, 16), (6, 6), (7, 7)])
def test_default_group_size_is_the_largest_divisor_up_to_32(head_dim, group):
    assert default_group_size(head_dim) == group
    assert head_dim % group == 0 and all(head_dim % g for g in range(group + 1, 33))


@pytest.mark.parametrize("head_dim", [40, 80])
@pytest.mark.parametrize("kv", ["int4", "int2"])
def test_kivi_spec_with_the_default_group_fits_any_head_dim(head_dim, kv):
    s = spec(head_dim=head_dim, kv_cache_dtype=kv)
    assert s.group_size == 20 and s.kv_cache_dtype == kv
    c = kvcache.init_cache(s)
    assert c.v[0].scale.shape == (5, 4, 2, head_dim // 20)       # per-token value groups
    assert c.k[0].scale.shape == (5, 1, 2, head_dim)             # per-channel keys


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_layers=0), "num_layers=0"),
    (dict(num_blocks=1), "num_blocks=1"),
    (dict(block_size=2.5), "block_size=2.5"),
    (dict(num_kv_heads=True), "num_kv_heads=True"),
    (dict(head_dim=-8), "head_dim=-8"),
    (dict(dtype="float64"), "dtype='float64'"),
    (dict(kv_cache_dtype="int3"), "kv_cache_dtype='int3'"),
    (dict(kv_cache_dtype="int4", group_size=0), "group_size=0"),
    (dict(kv_cache_dtype="int4", group_size=12), "group_size=12 must divide head_dim=16"),
    (dict(kv_cache_dtype="int4", block_size=1), "block_size=1 must be >= 2"),
    (dict(kv_cache_dtype="int2", head_dim=6), "head_dim=6 must be a multiple of 4"),
    (dict(residual_blocks=0), "residual_blocks=0"),
    (dict(kv_cache_dtype="int4", residual_blocks=3, num_residual_slots=2),
     "num_residual_slots=2 must be >= residual_blocks=3"),
    (dict(key_axis="head"), "key_axis='head'"),
    (dict(value_axis=None), "value_axis=None"),
    (dict(kv_cache_dtype="int8", static_scale=0.1), "static_scale applies to"),
    (dict(kv_cache_dtype="fp8", static_scale=-1.0), "static_scale=-1.0"),
    (dict(layout="hdn"), "kv_layout='hdn'"),
    (dict(kv_cache_dtype="int8", layout="hnd"), "kv_layout='hnd' holds float pools only"),
])
def test_bad_specs_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        spec(**kwargs)


def test_spec_is_normalized_and_hashable():
    s = spec(dtype="bfloat16")
    assert (s.kv_cache_dtype, s.group_size, s.num_residual_slots) == ("bf16", 16, 2)
    assert s == spec(dtype="bfloat16", kv_cache_dtype="bfloat16", group_size=16)
    assert len({s, spec(dtype="bfloat16", kv_cache_dtype="auto")}) == 1
    assert spec(kv_cache_dtype="fp8", static_scale=0.5).kv_cache_dtype == "fp8_e4m3"


CONFIG = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=256)


@pytest.mark.parametrize("kv", list(KV_FORMATS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_init_cache_allocates_what_the_planner_counts(kv, dtype):
    """Shapes and dtypes by hand from the layout table, bytes equal to the spec's and to the
    planner's pool + residual for the same geometry."""
    n, bs, h, d, slots = 5, 4, 2, 16, kivi_residual_slots(3, 1)
    s = spec(dtype=dtype, kv_cache_dtype=kv, num_residual_slots=slots)
    f = s.format
    c = kvcache.init_cache(s)
    assert c.num_layers == 2 and c.kv_cache_dtype == kv
    for pool, axis in ((c.k[0], "channel"), (c.v[1], "token")):
        assert pool.shape == (n, bs, h, d)
        shapes = {name: (tuple(a.shape), jnp.dtype(a.dtype).name)
                  for name, a in (vars(pool).items() if f.quantized else [("data", pool)])
                  if hasattr(a, "shape")}
        want = {"data": ((n, bs, h, d * f.bits // 8 if f.bits < 8 else d), f.storage)}
        # keys of KIVI per channel over a block; otherwise one scale per token (G = D = 16)
        stats = (n, 1, h, d) if f.kivi and axis == "channel" else (n, bs, h, 1)
        if f.quantized:
            want["scale"] = (stats, "bfloat16")
        if f.kivi:
            want.update(zero=(stats, "bfloat16"), res_slot=((n,), "int32"),
                        sealed=((n,), "bool"), residual=((slots + 1, bs, h, d), dtype),
                        res_owner=((slots + 1,), "int32"), res_stamp=((slots + 1,), "int32"),
                        clock=((), "int32"))
        assert shapes == want
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(c))
    assert c.nbytes == s.nbytes
    p = memory_plan.plan(CONFIG, device_memory_bytes=1 << 30, dtype=dtype, kv_cache_dtype=kv,
                     block_size=bs, max_num_seqs=3, max_model_len=8, num_kv_blocks=n)
    assert p.num_blocks == n and p.kv_bytes_per_block == s.block_bytes
    assert p.kv_cache_bytes + p.kv_residual_bytes == c.nbytes
    if not f.kivi:
        assert s.block_bytes == bs * memory_plan.kv_bytes_per_token(CONFIG, kv)
        assert s.block_bytes == 2 * 2 * bs * h * (d * f.bits // 8 + f.metadata_bytes)


def test_static_scale_pools_have_no_scales():
    c = kvcache.init_cache(spec(kv_cache_dtype="fp8_e5m2", static_scale=0.01))
    assert c.k[0].scale is None and c.k[0].static_scale == 0.01
    assert c.nbytes == 2 * 2 * math.prod((5, 4, 2, 16))


def test_abstract_cache_allocates_nothing_and_matches():
    s = spec(kv_cache_dtype="int4")
    a, c = kvcache.abstract_cache(s), kvcache.init_cache(s)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(a))
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(a)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(c)]


def test_pallas_support_is_checked_on_the_spec():
    from jaxkv.attention.pallas.kv_format import check_pallas_support

    check_pallas_support(spec(head_dim=64, kv_cache_dtype="int4"))
    check_pallas_support(spec(head_dim=128, kv_cache_dtype="fp8_e4m3", static_scale=1.0))
    with pytest.raises(ValueError, match="kv_layout='hnd': the Pallas kernels read NHD"):
        check_pallas_support(spec(head_dim=64, layout="hnd"))
    with pytest.raises(ValueError, match="head_dim=80 must be a power of two"):
        check_pallas_support(spec(head_dim=80))
    with pytest.raises(ValueError, match="8-channel chunks"):
        check_pallas_support(spec(head_dim=32, kv_cache_dtype="int2"))
    with pytest.raises(ValueError, match="residual_full_precision=False"):
        check_pallas_support(spec(head_dim=64, kv_cache_dtype="int4",
                                  residual_full_precision=False))
