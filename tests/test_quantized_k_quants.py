"""GGUF Q4_K tensors kept quantized, repacked as Q4_1 in groups of 32 with float32 scales
(jaxkv/model/quantized.py ``from_q4_k``): bit-exact to the gguf package's decoder and to
test_gguf's independent one, the C++ and Pallas (interpret) kernels against a float64
dequantize-then-dot, and a tiny written GGUF whose Q4_K layers stay kept: the greedy tokens of
the dequantized load, the planner's count of the repacked bytes. Q6_K stays dequantized.
The real Q4_K_M file: tests/test_real_checkpoints.py (slow)."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import LLM, SamplingParams, cpu_kernels
from jaxkv.model import quantized
from jaxkv.model.quantized_matmul import quantized_matmul
from jaxkv.model.weights import load_model_files
from test_gguf import Q, austen, bpe, decode_q4_k, random_blocks, write_tiny_gguf  # noqa: F401
from test_quant_matmul import check_product   # |error| <= 1e-5 |x| @ |w|.T (float64)

# the K-quants of a tiny GGUF: Q4_K where K is a multiple of 256 (E), Q6_K dequantized
QTYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K}
# kept: those Q4_K ones, write_tiny_gguf's Q4_1 o_proj and down_proj, its Q8_0 embedding
KEPT = ("q_proj", "gate_proj", "up_proj", "o_proj", "down_proj", "embed_tokens")


def q4_k(rows: int, cols: int, seed: int = 0):
    """(random Q4_K bytes [rows, cols / 256 * 144], the kept QuantizedWeight of them)."""
    raw = random_blocks(Q.Q4_K, rows, cols, seed)
    return raw, quantized.from_gguf(raw, "Q4_K")


def as_bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("rows,cols", [(3, 256), (5, 1024)])
def test_repack_dequantizes_bit_exactly(rows, cols):
    raw, w = q4_k(rows, cols, seed=rows)
    assert (w.qtype, w.group, w.shape, w.d.dtype, w.m.dtype) == (
        "Q4_1", 32, (rows, cols), np.float32, np.float32)
    want = gguf.quants.dequantize(raw, Q.Q4_K).reshape(rows, cols)
    np.testing.assert_array_equal(as_bits(quantized.dequantize_numpy(w)), as_bits(want))
    np.testing.assert_array_equal(as_bits(decode_q4_k(raw, rows)), as_bits(want))
    device = quantized.to_device(w, w.shape)
    np.testing.assert_array_equal(as_bits(quantized.dequantize(device)), as_bits(want))
    # 4-bit codes and an f32 scale and minimum per 32 values: 0.75 bytes a weight
    assert w.nbytes == quantized.kept_bytes("Q4_K", raw.nbytes, rows * cols) == rows * cols * 3 // 4


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 130])     # registers; the panel past 8 rows
def test_cpu_kernel_equals_dequantize_then_dot(rows):
    """One call over a Q4_K weight (f32 scales) and a GGUF Q4_1 one (f16 scales)."""
    if not cpu_kernels.native():
        pytest.skip("the C++ kernels are not built here")
    _, wk = q4_k(70, 512, seed=rows)
    raw = random_blocks(Q.Q4_1, 40, 512, seed=rows).reshape(40, 16, 20)
    raw[..., 2:4] = np.full((40, 16, 1), 0.25, np.float16).view(np.uint8)   # finite minima
    w1 = quantized.from_gguf(raw.reshape(40, -1), "Q4_1")
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    ws = [quantized.to_device(w, w.shape) for w in (wk, w1)]
    outs = cpu_kernels.quant_matmuls(jnp.asarray(x), ws)
    for out, w in zip(outs, (wk, w1)):
        check_product(out, x, quantized.dequantize_numpy(w))


@pytest.mark.parametrize("M", [1, 5, 33])
def test_pallas_kernel_equals_dequantize_then_dot(M):
    _, w = q4_k(128, 512, seed=M)
    x = np.random.default_rng(M).standard_normal((M, 512)).astype(np.float32)
    got = quantized_matmul(jnp.asarray(x), quantized.to_device(w, w.shape), interpret=True, bn=64)
    check_product(got, x, quantized.dequantize_numpy(w))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bpe):  # noqa: F811
    path = tmp_path_factory.mktemp("k_quants") / "k.gguf"
    return path, write_tiny_gguf(path, bpe, qtypes=QTYPES)


def test_the_loader_keeps_q4_k_and_dequantizes_q6_k(tiny):
    path, expected = tiny
    m = load_model_files(path, keep_quantized=True)
    for name, want in expected.items():
        got = m.tensors[name]
        kept = any(f".{k}." in f".{name}" for k in KEPT)
        assert isinstance(got, quantized.QuantizedWeight) == kept, name
        value = quantized.dequantize_numpy(got) if kept else got
        np.testing.assert_array_equal(as_bits(value), as_bits(want), err_msg=name)


def test_kept_q4_k_gives_the_dequantized_models_tokens(tiny):
    path, _ = tiny
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
    prompts = ["It is a truth universally", "Emma Woodhouse, handsome,", "She was"]
    runs = []
    for q in (None, "none"):
        with LLM(model=str(path), quantization=q, max_num_seqs=4, max_model_len=128) as llm:
            outs = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
            runner = llm.engine.runner
            nbytes = sum(x.nbytes for x in jax.tree.leaves(runner.params))
            runs.append((outs, nbytes, runner.memory_plan))
    (kept, kept_bytes, kept_plan), (deq, deq_bytes, _) = runs
    for a, b in zip(kept, deq):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):      # fp32 summation order
            np.testing.assert_allclose(list(la.values()), list(lb.values()), rtol=1e-4,
                                       atol=1e-3)
    assert kept_bytes < deq_bytes
    assert kept_plan.weights_bytes == kept_bytes and "Q4_K" in kept_plan.summary()
