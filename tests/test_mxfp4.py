"""MXFP4 checkpoints (gpt-oss's experts as shipped), kept in their codes or de-quantized at
load: the decoder against transformers' own (``convert_moe_packed_tensors``), the kept stacks
bit-exact to it and the CPU kernel's product against a float64 one, and a tiny gpt-oss whose
experts are MXFP4 through the engine, kept and de-quantized, against transformers loading the
same directory with ``Mxfp4Config(dequantize=True)`` (fp32, greedy tokens and logprobs).
tests/test_pallas_quantized_matmul.py checks the GPU kernel, tests/test_gpu_compile.py
compiles it."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxkv import LLM, SamplingParams, cpu_kernels  # noqa: E402
from jaxkv.model import mxfp4, quantized  # noqa: E402
from jaxkv.model.quantized import QuantizedWeight  # noqa: E402
from jaxkv.model.weights import load_model_files  # noqa: E402
from tiny_models import (  # noqa: E402
    assert_greedy_equals_hf, austen_text, save_tiny_model, save_tokenizer)

NEW_TOKENS = 32
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32,
              block_size=8, token_buckets=(8, 32), seq_buckets=(2,), num_kv_blocks=80)


def _random_packed(shape, seed):
    """Random MXFP4 ``(blocks, scales)`` of a ``[X, out, in]`` weight, scales 2^-6 .. 2^0."""
    g = torch.Generator().manual_seed(seed)
    x, out, n = shape
    return (torch.randint(0, 256, (x, out, n // 32, 16), dtype=torch.uint8, generator=g),
            torch.randint(121, 128, (x, out, n // 32), dtype=torch.uint8, generator=g))


def test_dequantize_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_packed((3, 40, 96), seed=1)
    scales[0, 0, 0], scales[1, 2, 1] = 0, 255          # the extreme exponents, too
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()   # [X, in, out]
    got = mxfp4.convert_checkpoint({"w_blocks": blocks.numpy(), "w_scales": scales.numpy()},
                                      "test")["w"]
    assert got.shape == want.shape == (3, 96, 40)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_kept_stack_is_bit_exact_and_the_kernel_equals_the_product(rows):
    """``mxfp4.keep``'s codes and E8M0 scales dequantize (numpy and jax) to exactly the
    decoder's values, expert by expert; the C++ kernel's product (few rows in registers, 40
    through a dequantized panel) equals a float64 product within rtol 1e-5. Scales 2^-125 ..
    2^8: XLA flushes a subnormal product to zero, the smallest exponents (0, 1) make them."""
    blocks, scales = _random_packed((2, 48, 160), seed=rows)
    scales[0, 0, 0], scales[1, 3, 4] = 2, 135
    blocks, scales = blocks.numpy(), scales.numpy()
    w = mxfp4.keep(blocks, scales)
    assert (w.qtype, w.shape, w.group, w.qs.shape, w.d.dtype) == (
        "MXFP4", (2, 160, 48), 32, (2, 48, 80), np.uint8)
    assert w.nbytes == mxfp4.nbytes(w.shape) == 2 * 48 * (80 + 5)
    want = mxfp4.dequantize(blocks, scales)                        # [X, out, in]
    x = np.random.default_rng(rows).normal(size=(rows, 160)).astype(np.float32)
    for g in range(2):
        e = w.expert(g)
        np.testing.assert_array_equal(quantized.dequantize_numpy(e), want[g])
        on_device = jax.tree.map(jnp.asarray, e)
        np.testing.assert_array_equal(np.asarray(quantized.dequantize(on_device)), want[g])
        if cpu_kernels.native():
            (got,) = cpu_kernels.quant_matmuls(jnp.asarray(x), [on_device])
            ref = x.astype(np.float64) @ want[g].T.astype(np.float64)
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5,
                                       atol=1e-5 * np.abs(ref).max())


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """A tiny gpt-oss (sliding / full / sliding with sinks, 6 experts, top 2) whose experts are
    stored as HF's gpt-oss checkpoints store them: MXFP4 blocks and scales."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    save_tokenizer(path)
    save_tiny_model(path, "gpt_oss", num_hidden_layers=3, head_dim=24, sliding_window=16,
                    intermediate_size=64, num_local_experts=6, num_experts_per_tok=2)
    tensors = load_file(path / "model.safetensors")
    experts = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for i, name in enumerate(experts):
        x, n, out = tensors.pop(name).shape                     # [X, in, out]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = _random_packed((x, out, n), i)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("quantization", [None, "none"])
def test_mxfp4_gpt_oss_equals_transformers(gpt_oss_mxfp4, quantization):
    """jaxkv's engine (hybrid cache, chunked prefill) on the MXFP4 directory, its experts kept
    (as stored, the default) or de-quantized, gives the greedy tokens and logprobs of
    transformers de-quantizing the same files."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gpt_oss_mxfp4, quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32).eval()
    prompt = transformers.AutoTokenizer.from_pretrained(gpt_oss_mxfp4)(austen_text(3000)).input_ids
    assert_greedy_equals_hf(gpt_oss_mxfp4, hf, prompt[:70], NEW_TOKENS, quantization=quantization,
                            **ENGINE)


def test_kept_experts_are_mxfp4_stacks_the_planner_counts(gpt_oss_mxfp4):
    """As stored, each layer's gate, up and down are MXFP4 stacks (gate and up the interleaved
    rows of gate_up_proj), and the planner's weights are the bytes the engine holds, below the
    de-quantized engine's."""
    held = {}
    for mode in (None, "none"):
        with LLM(str(gpt_oss_mxfp4), quantization=mode, **ENGINE) as llm:
            runner = llm.engine.runner
            kept = [w for w in jax.tree.leaves(runner.params, is_leaf=lambda a: isinstance(
                a, QuantizedWeight)) if isinstance(w, QuantizedWeight)]
            held[mode] = sum(int(a.nbytes) for a in jax.tree.leaves(runner.params))
            assert runner.memory_plan.weights_bytes == held[mode]
            if mode is None:
                mlp = runner.params["layers"][0]["mlp"]
                up_codes = np.asarray(mlp["up_proj"].qs)
                assert "MXFP4 experts kept" in runner.memory_plan.weights_format
        assert len(kept) == (9 if mode is None else 0)
    assert {(w.qtype, w.shape, w.group) for w in [mlp["gate_proj"], mlp["up_proj"],
                                                  mlp["down_proj"]]} == {("MXFP4", (6, 64, 64), 32)}
    tensors = load_model_files(gpt_oss_mxfp4, keep_quantized=True).tensors
    gate_up = tensors["model.layers.0.mlp.experts.gate_up_proj"]      # rows: gate, up, gate...
    np.testing.assert_array_equal(up_codes, gate_up.qs[:, 1::2])
    assert held[None] < held["none"]


def test_bad_quantized_checkpoints_are_refused(gpt_oss_mxfp4, tmp_path):
    from safetensors.numpy import save_file

    config = json.loads((gpt_oss_mxfp4 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "quantization_config": {"quant_method": "awq"}}))
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="quantization_config.quant_method='awq' is not supported"):
        load_model_files(tmp_path)
    with pytest.raises(ValueError, match="'w' needs both w_blocks and w_scales"):
        mxfp4.convert_checkpoint({"w_blocks": np.zeros((1, 2, 1, 16), np.uint8)}, "test")
    with pytest.raises(ValueError, match="do not match scales"):
        mxfp4.dequantize(np.zeros((2, 1, 16), np.uint8), np.zeros((2, 2), np.uint8))


def _tp_run(path: str) -> dict:
    """Greedy tokens, logprobs and layer 0's stacks' shard shapes of one engine at tp 2."""
    from tp_runner import quantized_run

    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
        done = [llm.generate({"prompt_token_ids": TP_PROMPT}, sp, use_tqdm=False)[0].outputs[0]]
        mlp = llm.engine.runner.params["layers"][0]["mlp"]
        return quantized_run(done, llm.engine.runner, {k: w for k, w in mlp.items()
                                                       if isinstance(w, QuantizedWeight)})


TP_PROMPT = list(range(3, 40))


def test_tp_splits_the_mxfp4_experts_by_width(gpt_oss_mxfp4):
    """At tp 2 the experts stay MXFP4 (each device's K of down, 32 of 64, whole blocks; the
    attention's o_proj, 96 wide, is float and need not split into blocks): gate and up split
    by rows, down by K with its scales; the greedy tokens and logprobs of transformers
    de-quantizing the same files."""
    from tp_runner import run_script

    got = run_script(__file__, gpt_oss_mxfp4, devices=2, timeout=300)
    assert got["shards"] == {"gate_proj": [[6, 32, 32], [6, 32, 2]], "up_proj": [[6, 32, 32],
                             [6, 32, 2]], "down_proj": [[6, 64, 16], [6, 64, 1]]}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gpt_oss_mxfp4, quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([TP_PROMPT]), max_new_tokens=8, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0]
        logits = hf(out[None]).logits[0, len(TP_PROMPT) - 1:-1].double()
    want = out[len(TP_PROMPT):]
    assert got["tokens"] == [want.tolist()]
    np.testing.assert_allclose(got["logprobs"][0], torch.log_softmax(logits, -1)[
        torch.arange(8), want].numpy(), atol=1e-4, rtol=0)


if __name__ == "__main__":
    print(json.dumps(_tp_run(sys.argv[1])))
