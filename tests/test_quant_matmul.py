"""The fused-dequant matmul (jaxkv/cpu_kernels/quant_matmul.cc) and the GGUF block repacking
(jaxkv/model/quantized.py) against independent references: the ``gguf`` package's quantizer
and dequantizer and test_gguf's numpy block decoders, the products in float64 numpy."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import cpu_kernels
from jaxkv.model import linear, quantized
from test_gguf import decode_q4_0, decode_q4_1, decode_q8_0, random_blocks

Q = gguf.GGMLQuantizationType
DECODERS = {"Q8_0": decode_q8_0, "Q4_0": decode_q4_0, "Q4_1": decode_q4_1}
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="native CPU kernels unavailable")


def stored(qtype, rows, cols, seed=0, quantizer=True):
    """(GGUF bytes [rows, cols / 32 * block bytes], their float32 [rows, cols] by test_gguf's
    decoder): gguf's quantizer of random normals, or random blocks (any codes)."""
    if quantizer:
        w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        raw = gguf.quants.quantize(w, Q[qtype])
    else:                   # random codes, finite scales (and minimums: Q4_1's bytes 2-3)
        raw = random_blocks(Q[qtype], rows, cols, seed).reshape(rows, cols // 32, -1)
        if qtype == "Q4_1":
            m = np.random.default_rng(seed).uniform(-0.5, 0.5, raw.shape[:2] + (1,))
            raw[..., 2:4] = m.astype(np.float16).view(np.uint8)
        raw = raw.reshape(rows, -1)
    return raw, DECODERS[qtype](raw, rows)


def check_product(out, x, w):
    """out equals x @ w.T of float64 up to summation order: |error| <= 1e-5 |x| @ |w|.T
    elementwise (rtol 1e-5 of the sum of the products' magnitudes)."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    ref, scale = x @ w.T, np.abs(x) @ np.abs(w).T
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert out.shape == ref.shape
    assert np.all(err <= 1e-5 * scale + 1e-30), float(np.max(err / (scale + 1e-30)))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("quantizer", [True, False])
def test_repacked_blocks_dequantize_bit_exactly(qtype, quantizer):
    raw, want = stored(qtype, 13, 96, quantizer=quantizer)
    w = quantized.from_gguf(raw, qtype)
    assert (w.rows, w.cols, w.shape, w.nbytes) == (13, 96, (13, 96), raw.nbytes)
    np.testing.assert_array_equal(quantized.to_gguf(w), raw)
    np.testing.assert_array_equal(quantized.dequantize_numpy(w), want)
    np.testing.assert_array_equal(quantized.dequantize_numpy(w),
                                  gguf.quants.dequantize(raw, Q[qtype]))
    np.testing.assert_array_equal(np.asarray(quantized.dequantize(w.map_rows(jnp.asarray))), want)


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_kernel_equals_dequantize_then_dot(qtype, rows):
    """Odd output sizes (not multiples of the 3-row passes or 16-row items) and K of 1, 3 and
    18 blocks; decode rows (in registers) and prefill rows (through the panel)."""
    rng = np.random.default_rng(rows)
    for n, k in [(1, 32), (7, 96), (50, 576), (33, 128)]:
        raw, w = stored(qtype, n, k, seed=n + k, quantizer=n % 2 == 1)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        q = quantized.from_gguf(raw, qtype).map_rows(jnp.asarray)
        out, = cpu_kernels.quant_matmuls(jnp.asarray(x), [q])
        check_product(out, x, w)


@needs_kernels
def test_kernel_splits_many_rows_into_spans():
    """More than 512 rows: work items over spans of x's rows (the kernel serves any count;
    ``linear`` takes it up to 128)."""
    raw, w = stored("Q4_1", 70, 64, seed=3)
    x = np.random.default_rng(3).standard_normal((600, 64)).astype(np.float32)
    out, = cpu_kernels.quant_matmuls(jnp.asarray(x), [quantized.from_gguf(raw, "Q4_1").map_rows(
        jnp.asarray)])
    check_product(out, x, w)


@needs_kernels
def test_one_call_computes_several_weights():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    parts = [stored("Q4_1", n, 64, seed=n) for n in (19, 8, 40)]
    qs = [quantized.from_gguf(raw, "Q4_1").map_rows(jnp.asarray) for raw, _ in parts]
    outs = cpu_kernels.quant_matmuls(jnp.asarray(x), qs)
    for out, (_, w) in zip(outs, parts):
        check_product(out, x, w)
    with pytest.raises(ValueError, match="one qtype"):
        cpu_kernels.quant_matmuls(jnp.asarray(x), [qs[0], quantized.from_gguf(
            stored("Q8_0", 4, 64)[0], "Q8_0").map_rows(jnp.asarray)])
    with pytest.raises(ValueError, match="do not contract"):
        cpu_kernels.quant_matmuls(jnp.asarray(x[:, :32]), qs[:1])


@pytest.mark.parametrize("native", [True, False])
def test_linear_reads_a_quantized_weight_as_its_float_param(monkeypatch, native):
    """``linears`` of a weight [E, H, D] kept as [H * D, E] blocks, beside a float weight,
    and ``linear_t`` of an embedding [V, E]: the kernel, or dequantize-then-dot elsewhere."""
    if native and not cpu_kernels.available():
        pytest.skip("native CPU kernels unavailable")
    monkeypatch.setattr(cpu_kernels, "native", lambda: native)
    rng = np.random.default_rng(2)
    raw, w = stored("Q4_0", 4 * 24, 64)                              # [H * D, E]
    q = quantized.from_gguf(raw, "Q4_0").map_rows(jnp.asarray).reshape(64, 4, 24)
    f = rng.standard_normal((64, 10)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    a, b = linear.linears(jnp.asarray(x), (q, jnp.asarray(f)))
    assert a.shape == (3, 4, 24) and b.shape == (3, 10)
    check_product(np.asarray(a).reshape(3, -1), x, w)
    check_product(np.asarray(b), x, f.T)
    check_product(linear.linear_t(jnp.asarray(x), q.reshape(96, 64)), x, w)
    ids = jnp.asarray([5, 0, 95, 5])
    np.testing.assert_array_equal(quantized.rows(q.reshape(96, 64), ids), w[np.asarray(ids)])


def test_reshape_keeps_the_blocks():
    q = quantized.from_gguf(stored("Q8_0", 6, 64)[0], "Q8_0")
    assert q.reshape(64, 2, 3).out_shape() == (2, 3)
    assert q.reshape(-1, 6).shape == (64, 6) and q[...] is q
    with pytest.raises(ValueError, match="cannot reshape"):
        q.reshape(7, 64)
    with pytest.raises(TypeError, match="read whole"):
        q[0]
