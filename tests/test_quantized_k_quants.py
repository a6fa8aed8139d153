"""GGUF Q4_K and Q6_K tensors kept quantized, repacked as Q4_1 in groups of 32 / Q8_0 codes in
groups of 16 with float32 scales (jaxkv/model/quantized.py ``from_q4_k``, ``from_q6_k``):
bit-exact to the gguf package's decoder and to test_gguf's independent ones, the C++ and Pallas
(interpret) kernels against a float64 dequantize-then-dot, and a tiny written GGUF whose
K-quant layers stay kept: the greedy tokens of the dequantized load, the planner's count of the
repacked bytes. The real Q4_K_M file: tests/test_real_checkpoints.py (slow)."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import LLM, SamplingParams, cpu_kernels
from jaxkv.model import quantized
from jaxkv.model.quantized_matmul import quantized_matmul
from jaxkv.model.weights import load_model_files
from test_gguf import (Q, austen, bpe, decode_q4_k, decode_q6_k,  # noqa: F401  (fixtures)
                       random_blocks, write_tiny_gguf)
from test_quant_matmul import check_product   # |error| <= 1e-5 |x| @ |w|.T (float64)

# the K-quants of a tiny GGUF where K is a multiple of 256 (E); Q5_K stays dequantized
QTYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "attn_v": Q.Q5_K, "ffn_gate": Q.Q4_K,
          "ffn_up": Q.Q6_K}
# kept: those Q4_K / Q6_K ones, write_tiny_gguf's Q4_1 o_proj and down_proj, its Q8_0 embedding
KEPT = ("q_proj", "k_proj", "gate_proj", "up_proj", "o_proj", "down_proj", "embed_tokens")
# each K-quant: its repacked code type, group, and test_gguf's independent decoder
REPACKED = {"Q4_K": ("Q4_1", 32, decode_q4_k), "Q6_K": ("Q8_0", 16, decode_q6_k)}


def k_quant(qtype: str, rows: int, cols: int, seed: int = 0):
    """(random ``qtype`` bytes [rows, cols / 256 * block bytes], its kept QuantizedWeight)."""
    raw = random_blocks(Q[qtype], rows, cols, seed)
    return raw, quantized.from_gguf(raw, qtype)


def as_bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", list(REPACKED))
@pytest.mark.parametrize("rows,cols", [(3, 256), (5, 1024)])
def test_repack_dequantizes_bit_exactly(qtype, rows, cols):
    raw, w = k_quant(qtype, rows, cols, seed=rows)
    code, group, decode = REPACKED[qtype]
    assert (w.qtype, w.group, w.shape, w.d.dtype) == (code, group, (rows, cols), np.float32)
    want = gguf.quants.dequantize(raw, Q[qtype]).reshape(rows, cols)
    np.testing.assert_array_equal(as_bits(quantized.dequantize_numpy(w)), as_bits(want))
    np.testing.assert_array_equal(as_bits(decode(raw, rows)), as_bits(want))
    device = quantized.to_device(w, w.shape)
    np.testing.assert_array_equal(as_bits(quantized.dequantize(device)), as_bits(want))
    # Q4_K: 4-bit codes, an f32 scale and minimum per 32 values (0.75 bytes a weight); Q6_K:
    # int8 codes, an f32 scale per 16 (1.25)
    per_weight = {"Q4_K": 0.75, "Q6_K": 1.25}[qtype]
    assert w.nbytes == quantized.kept_bytes(qtype, raw.nbytes, rows * cols) == \
        rows * cols * per_weight


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 130])     # registers; the panel past 8 rows
def test_cpu_kernel_equals_dequantize_then_dot(rows):
    """A Q4_K weight (f32 scales) and a GGUF Q4_1 one (f16 scales) in one call; a Q6_K one
    (Q8_0 codes, an f32 scale per 16 values)."""
    if not cpu_kernels.native():
        pytest.skip("the C++ kernels are not built here")
    _, wk = k_quant("Q4_K", 70, 512, seed=rows)
    raw = random_blocks(Q.Q4_1, 40, 512, seed=rows).reshape(40, 16, 20)
    raw[..., 2:4] = np.full((40, 16, 1), 0.25, np.float16).view(np.uint8)   # finite minima
    w1 = quantized.from_gguf(raw.reshape(40, -1), "Q4_1")
    _, w6 = k_quant("Q6_K", 50, 512, seed=rows)
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    dev = [quantized.to_device(w, w.shape) for w in (wk, w1, w6)]
    outs = (*cpu_kernels.quant_matmuls(jnp.asarray(x), dev[:2]),
            *cpu_kernels.quant_matmuls(jnp.asarray(x), dev[2:]))
    for out, w in zip(outs, (wk, w1, w6)):
        check_product(out, x, quantized.dequantize_numpy(w))


@pytest.mark.parametrize("qtype", list(REPACKED))
@pytest.mark.parametrize("M", [1, 5, 33])
def test_pallas_kernel_equals_dequantize_then_dot(qtype, M):
    _, w = k_quant(qtype, 128, 512, seed=M)
    x = np.random.default_rng(M).standard_normal((M, 512)).astype(np.float32)
    got = quantized_matmul(jnp.asarray(x), quantized.to_device(w, w.shape), interpret=True, bn=64)
    check_product(got, x, quantized.dequantize_numpy(w))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bpe):  # noqa: F811
    path = tmp_path_factory.mktemp("k_quants") / "k.gguf"
    return path, write_tiny_gguf(path, bpe, qtypes=QTYPES)


def test_the_loader_keeps_q4_k_and_q6_k(tiny):
    path, expected = tiny
    m = load_model_files(path, keep_quantized=True)
    for name, want in expected.items():
        got = m.tensors[name]
        kept = any(f".{k}." in f".{name}" for k in KEPT)
        assert isinstance(got, quantized.QuantizedWeight) == kept, name
        value = quantized.dequantize_numpy(got) if kept else got
        np.testing.assert_array_equal(as_bits(value), as_bits(want), err_msg=name)


def test_kept_k_quants_give_the_dequantized_models_tokens(tiny):
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
    assert kept_plan.weights_bytes == kept_bytes
    assert "Q4_K" in kept_plan.summary() and "Q6_K" in kept_plan.summary()
