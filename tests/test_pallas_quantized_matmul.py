"""The Pallas matmul over quantized weights (jaxkv/model/quantized_matmul.py) in interpret mode
against numpy's dequantize-then-dot (float64): every GGUF kept type, MXFP4 (gpt-oss's experts),
the groups and fp8 codes of weights quantized at load, odd row counts, float32 and bfloat16
activations.
tests/test_gpu_compile.py compiles it for an H100."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.model.quantized import QuantizedWeight, dequantize_numpy
from jaxkv.model.quantized_matmul import quantized_matmul


def random_weight(rng, qtype: str, N: int, K: int, group: int = 32) -> QuantizedWeight:
    """Random codes (fp8: bytes with bit 3 clear, never e4m3's NaN), scales (MXFP4: E8M0
    exponents 2^-10 .. 2^4) and (Q4_1) minimums in the stored layout, one scale per ``group``
    values, as jax arrays."""
    groups = -(-K // group)
    d = (rng.random((N, groups)) * 0.02 + 1e-3).astype(np.float16)
    if qtype == "MXFP4":
        d = rng.integers(117, 132, (N, groups), dtype=np.uint8)
    m = (rng.normal(size=(N, groups)) * 0.01).astype(np.float16) if qtype == "Q4_1" else None
    if qtype == "Q8_0":
        qs = rng.integers(-128, 128, (N, K), dtype=np.int8)
    elif qtype == "F8_E4M3":
        qs = (rng.integers(0, 256, (N, K), dtype=np.uint8) & 0xF7).view(jnp.float8_e4m3fn)
    else:
        qs = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    return jax.tree.map(jnp.asarray, QuantizedWeight(qs, d, m, qtype, (N, K), group))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "MXFP4"])
@pytest.mark.parametrize("M,N,K", [(1, 64, 64), (3, 128, 96), (17, 192, 160), (40, 128, 64)])
def test_equals_dequantize_then_dot(qtype, M, N, K):
    rng = np.random.default_rng(M * N + K)
    w = random_weight(rng, qtype, N, K)
    x = rng.normal(size=(M, K)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize_numpy(w).astype(np.float64).T
    got = quantized_matmul(jnp.asarray(x), w, interpret=True, bn=64)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype,group", [("Q4_1", 64), ("Q4_1", 128), ("Q8_0", 160),
                                         ("F8_E4M3", 160), ("F8_E4M3", 32)])
def test_groups_and_fp8_codes_equal_dequantize_then_dot(qtype, group):
    """Weights as ``jaxkv.model.quantize`` stores them: a scale per group of 64, or of 128
    with a partial last group (K = 576), per output channel (group = K), and fp8 codes."""
    K = {64: 640, 128: 576}.get(group, 160)
    rng = np.random.default_rng(group)
    w = random_weight(rng, qtype, 64, K, group)
    x = rng.normal(size=(5, K)).astype(np.float32)
    want = x.astype(np.float64) @ dequantize_numpy(w).astype(np.float64).T
    got = quantized_matmul(jnp.asarray(x), w, interpret=True, bn=64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bfloat16_activations_accumulate_in_float32():
    """bf16 x, codes exact in bf16, float32 accumulation: within bf16's rounding of the result
    of the bf16-rounded x."""
    rng = np.random.default_rng(7)
    w = random_weight(rng, "Q4_1", 128, 256)
    x = jnp.asarray(rng.normal(size=(5, 256)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ dequantize_numpy(w).astype(np.float64).T
    got = quantized_matmul(x, w, interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2,
                               atol=1e-2 * np.abs(want).max())


def test_widths_it_cannot_tile_are_refused():
    w = random_weight(np.random.default_rng(0), "Q8_0", 96, 64)
    with pytest.raises(ValueError, match="N=96"):
        quantized_matmul(jnp.zeros((1, 64)), w, interpret=True)
