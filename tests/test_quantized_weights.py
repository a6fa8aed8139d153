"""GGUF weights kept in their Q8_0 / Q4_0 / Q4_1 blocks (``quantization=None``, the default)
against the dequantized model (``quantization="none"``): the loaded blocks against
test_gguf's independent decoders, greedy tokens and logprobs of the engine, the params' bytes
read from the arrays, and the memory planner's count of them.

The real-model checks (16 prompts x 32 tokens of SmolLM2-135M's Q4_1 file) are marked slow."""

import jax
import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.config import EngineConfig
from jaxkv.model import quantized
from jaxkv.model.weights import load_model_files, stored_weights_bytes
from jaxkv.runner.model_runner import plan_memory
from test_gguf import austen, bpe, write_tiny_gguf  # noqa: F401  (fixtures)

KEPT = {"self_attn.k_proj": "Q8_0", "self_attn.o_proj": "Q4_1", "mlp.up_proj": "Q4_0",
        "mlp.down_proj": "Q4_1", "embed_tokens": "Q8_0"}    # write_tiny_gguf's kept types


def kept_type(name: str) -> str | None:
    return next((q for k, q in KEPT.items() if f".{k}." in f".{name}"), None)


def params_bytes(llm) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(llm.engine.runner.params))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bpe):  # noqa: F811
    path = tmp_path_factory.mktemp("quantized") / "tiny.gguf"
    return path, write_tiny_gguf(path, bpe, tied=True)


def test_the_loader_keeps_the_blocks_as_stored(tiny):
    """Q8_0 / Q4_0 / Q4_1 dense weights and the embedding stay quantized, q/k rows
    un-permuted (k_proj is Q8_0), bit-exact to the independent decoders; F32 / F16 / BF16
    tensors are floats as before."""
    path, expected = tiny
    m = load_model_files(path, keep_quantized=True)
    assert set(m.tensors) == set(expected)
    for name, want in expected.items():
        got = m.tensors[name]
        if kept_type(name):
            assert isinstance(got, quantized.QuantizedWeight) and got.qtype == kept_type(name)
            assert got.shape == want.shape
            np.testing.assert_array_equal(quantized.dequantize_numpy(got), want, err_msg=name)
        else:
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_kept_weights_give_the_same_greedy_tokens(tiny):
    path, _ = tiny
    prompts = ["It is a truth universally", "Emma Woodhouse, handsome,", "Mr. Knightley",
               "She was"]
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    runs = {}
    for q in (None, "none"):
        llm = LLM(model=str(path), quantization=q, max_num_seqs=4, max_model_len=128)
        runs[q] = ([o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)],
                   params_bytes(llm), llm.engine.runner.memory_plan)
    (kept, kept_bytes, kept_plan), (deq, deq_bytes, deq_plan) = runs[None], runs["none"]
    for a, b in zip(kept, deq):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):   # logits of std ~16 (random N(0, 1)
            np.testing.assert_allclose(                # weights): fp32 summation order
                list(la.values()), list(lb.values()), rtol=1e-4, atol=1e-3)
    assert kept_bytes < deq_bytes / 2
    # the planner counts the weights at the bytes the arrays hold
    assert (kept_plan.weights_bytes, deq_plan.weights_bytes) == (kept_bytes, deq_bytes)
    assert "Q8_0/Q4_1/Q4_0 blocks kept" in kept_plan.summary()


def test_quantization_argument():
    assert EngineConfig.from_kwargs().model.quantization is None
    assert EngineConfig.from_kwargs(quantization="none").model.quantization == "none"
    for value in ("q4", "awq"):
        with pytest.raises(ValueError, match=f"quantization='{value}' is not one of: none"):
            EngineConfig.from_kwargs(quantization=value)
    # tensor parallelism keeps the blocks where every device gets whole blocks of o_proj's K
    # (576 / 3 = 6 blocks of 32); "none" and a method made at load do not keep the GGUF's
    from jaxkv.runner.model_runner import keeps_quantized
    assert keeps_quantized(EngineConfig.from_kwargs(tensor_parallel_size=3))
    assert keeps_quantized(EngineConfig.from_kwargs())
    for q in ("none", "int8"):
        assert not keeps_quantized(EngineConfig.from_kwargs(quantization=q))


# ---- the default model (SmolLM2-135M-Instruct, Q4_1 layers and a Q8_0 embedding) ----

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was",
           "List three primary colors:", "Water boils at", "The quick brown fox",
           "Translate to French: good morning", "1, 2, 3, 4,", "import numpy as np\n",
           "The best way to learn a language is", "Q: What is 7 times 8?\nA:",
           "My favourite book is", "In 1492, Columbus", "The sun rises in the",
           "Write a haiku about the sea:", "Photosynthesis is the process"]


@pytest.mark.slow
def test_default_model_kept_quantized_matches_the_dequantized_one():
    """16 prompts x 32 greedy tokens: the same ids, or a first difference at an fp32 near-tie
    (the dequantized model's top two logprobs within 1e-3 there)."""
    sp = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2, ignore_eos=True)
    runs, sizes, plans = {}, {}, {}
    for q in (None, "none"):
        llm = LLM(quantization=q, max_num_seqs=16, max_model_len=256)
        runs[q] = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        sizes[q], plans[q] = params_bytes(llm), llm.engine.runner.memory_plan
        del llm
    for a, b in zip(runs[None], runs["none"]):
        if a.token_ids != b.token_ids:
            i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            top = sorted(b.logprobs[i].values(), reverse=True)
            assert top[0] - top[1] < 1e-3, (i, top)
    assert sizes[None] == stored_weights_bytes(
        "SmolLM2-135M-Instruct", load_model_files("SmolLM2-135M-Instruct").config, 4)[0]
    assert sizes[None] < 0.2 * sizes["none"]
    assert (plans[None].weights_bytes, plans["none"].weights_bytes) == (sizes[None],
                                                                       sizes["none"])


@pytest.mark.slow
def test_the_kv_pool_grows_by_the_freed_bytes():
    from jaxkv.model.weights import load_config
    model = load_config("SmolLM2-135M-Instruct")
    gib = 1 << 30
    kept, deq = (plan_memory(EngineConfig.from_kwargs(quantization=q, max_num_seqs=64), model,
                             device_memory_bytes=4 * gib) for q in (None, "none"))
    freed = deq.weights_bytes - kept.weights_bytes
    assert freed > 400e6
    assert abs((kept.kv_cache_bytes - deq.kv_cache_bytes) - freed) <= kept.kv_bytes_per_block
