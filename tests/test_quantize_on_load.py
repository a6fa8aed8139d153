"""Weights quantized at load (jaxkv/model/quantize.py, ``LLM(quantization=...)``) against
independent references: the ``gguf`` package's decoders (int8 and int4 are GGUF's Q8_0 / Q4_1
formulas with wider groups), ml_dtypes' float8 conversion, float64 numpy products, and HF
transformers running the same dequantized weights."""

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv import LLM, cpu_kernels
from jaxkv.config import EngineConfig
from jaxkv.model import quantize
from jaxkv.model.quantized import QuantizedWeight, dequantize, dequantize_numpy, to_gguf
from jaxkv.model.weights import expected_shapes, load_config
from test_quant_matmul import check_product
from tiny_models import assert_greedy_equals_hf, save_tiny_model, save_tokenizer

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="native CPU kernels unavailable")
CASES = [("int8", 128), ("fp8", 128), ("int4", 32), ("int4", 64), ("int4", 128)]


def weights(n=24, k=576, seed=0):
    """float32 [n, k] like a layer's: normals of scale 0.05, a few outliers, one zero row."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[rng.integers(0, n, 5), rng.integers(0, k, 5)] = 0.6
    w[1] = 0.0
    return w


def as_gguf_blocks(q: QuantizedWeight) -> QuantizedWeight:
    """The same weight with its scales (and minima) repeated for every 32 values: GGUF's own
    Q8_0 / Q4_1 blocks, which ``gguf.quants.dequantize`` decodes."""
    per = q.group // 32

    def blocks(a):
        return np.repeat(np.asarray(a), per, axis=1)[:, :q.cols // 32]

    return QuantizedWeight(q.qs, blocks(q.d), None if q.m is None else blocks(q.m), q.qtype,
                           q.shape)


@pytest.mark.parametrize("method,group", [c for c in CASES if c[0] != "fp8"])
def test_int_codes_decode_as_gguf_decodes_its_blocks(method, group):
    """Scale and minimum per group (int4; the last of K = 576 partial at group 128) or per
    channel (int8), decoded by gguf's own Q4_1 / Q8_0 decoder, equal ours bit for bit; the
    error is at most half a step (the clipped ends: the rounded f16 scale's slack)."""
    w = weights()
    q = quantize.quantize(w, method, group)
    assert q.qtype == {"int8": "Q8_0", "int4": "Q4_1"}[method] and q.shape == w.shape
    assert q.d.shape == (24, 1 if method == "int8" else -(-576 // group))
    ours = dequantize_numpy(q)
    theirs = gguf.quants.dequantize(to_gguf(as_gguf_blocks(q)), gguf.GGMLQuantizationType[q.qtype])
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(np.asarray(dequantize(jax.tree.map(jnp.asarray, q))), ours)
    step = np.repeat(q.d.astype(np.float32), q.group, axis=1)[:, :576]
    assert np.all(np.abs(ours - w) <= 0.5 * step * (1 + 2e-3) + 1e-7)
    assert not ours[1].any()                                           # the zero row


def test_fp8_codes_decode_as_ml_dtypes_converts_them():
    w = weights()
    q = quantize.quantize(w, "fp8")
    assert q.qs.dtype == ml_dtypes.float8_e4m3fn and q.d.shape == (24, 1)
    want = q.qs.astype(np.float32) * q.d.astype(np.float32)
    np.testing.assert_array_equal(dequantize_numpy(q), want)
    amax = np.abs(w).max(axis=1, keepdims=True)
    assert np.all(np.abs(want - w) <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * amax)


@needs_kernels
@pytest.mark.parametrize("method,group", CASES)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_cpu_kernel_equals_dequantize_then_dot(method, group, rows):
    """Decode rows (in registers) and prefill rows (the panel), odd output counts, K = 576
    (partial last groups of 64 and 128) and K = 96."""
    rng = np.random.default_rng(rows)
    for n, k in [(24, 576), (7, 96)]:
        q = quantize.quantize(weights(n, k, seed=n), method, group)
        x = rng.standard_normal((rows, k)).astype(np.float32)
        out, = cpu_kernels.quant_matmuls(jnp.asarray(x), [jax.tree.map(jnp.asarray, q)])
        check_product(out, x, dequantize_numpy(q))


@needs_kernels
def test_cpu_kernel_reads_every_fp8_code_as_ml_dtypes():
    """Every finite e4m3 byte (normals, subnormals, both zeros, both signs), read through
    one-hot rows of x so each output is one weight value."""
    codes = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)   # 254 bytes
    k = 256
    qs = np.zeros((1, k), np.uint8)
    qs[0, :codes.size] = codes
    w = QuantizedWeight(qs.view(ml_dtypes.float8_e4m3fn), np.ones((1, 1), np.float16), None,
                        "F8_E4M3", (1, k), k)
    x = np.eye(k, dtype=np.float32)[:codes.size]
    out, = cpu_kernels.quant_matmuls(jnp.asarray(x), [jax.tree.map(jnp.asarray, w)])
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out)[:, 0], want)


def hf_with(model, method: str, group: int):
    """The torch model with each dense projection replaced by its quantized-then-dequantized
    weight: what the engine computes with, in HF's own forward."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if quantize.DENSE.fullmatch(name):
                q = quantize.quantize(p.numpy(), method, group)
                p.copy_(torch.from_numpy(dequantize_numpy(q)))
    return model


@pytest.fixture(scope="module")
def tiny_96(tmp_path_factory):
    """A tiny llama of hidden size 96 and MLP width 160: groups of 64 end partial."""
    path = tmp_path_factory.mktemp("tiny96")
    save_tokenizer(path)
    return path


@pytest.mark.parametrize("method,group", [("int8", 128), ("fp8", 128), ("int4", 64)])
def test_engine_equals_transformers_on_the_dequantized_weights(tiny_96, method, group):
    hf = hf_with(save_tiny_model(tiny_96, "llama", hidden_size=96, intermediate_size=160),
                 method, group)
    prompt = list(range(3, 40))
    assert_greedy_equals_hf(tiny_96, hf, prompt, 24, quantization=method,
                            quantization_group_size=group, max_model_len=128,
                            num_gpu_blocks_override=16, max_num_seqs=2)


def test_planner_counts_the_bytes_the_engine_holds(tiny_96):
    save_tiny_model(tiny_96, "llama", hidden_size=96, intermediate_size=160)
    with LLM(str(tiny_96), quantization="int4", quantization_group_size=64, max_model_len=64,
             num_gpu_blocks_override=8, max_num_seqs=1) as llm:
        runner = llm.engine.runner
        held = sum(int(a.nbytes) for a in jax.tree.leaves(runner.params))
        kept = [a for a in jax.tree.leaves(runner.params, is_leaf=lambda a: isinstance(
            a, QuantizedWeight)) if isinstance(a, QuantizedWeight)]
        plan = runner.memory_plan
    assert len(kept) == 2 * 7 and {w.qtype for w in kept} == {"Q4_1"}
    assert plan.weights_bytes == held
    assert "int4 (groups of 64) dense projections" in plan.weights_format
    config = load_config(tiny_96)
    assert quantize.stored_bytes(expected_shapes(config), "int4", 64, 4) == held


@pytest.mark.parametrize("kwargs,field", [
    (dict(quantization="int3"), "quantization='int3' is not one of"),
    (dict(quantization="int4", quantization_group_size=48), "quantization_group_size=48"),
    (dict(quantization="int4", quantization_group_size=0), "quantization_group_size"),
])
def test_bad_arguments_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(model="SmolLM2-135M-Instruct", **kwargs)


def test_a_width_the_kernels_cannot_block_is_refused_naming_the_tensor():
    tensors = {"model.layers.0.mlp.down_proj.weight": np.zeros((8, 40), np.float32),
               "model.embed_tokens.weight": np.zeros((10, 40), np.float32)}
    with pytest.raises(ValueError, match=r"f\.safetensors: quantization='int8': tensor "
                                         r"'model\.layers\.0\.mlp\.down_proj\.weight' \[8, 40\]"):
        quantize.quantize_tensors(tensors, "int8", 128, "f.safetensors")
