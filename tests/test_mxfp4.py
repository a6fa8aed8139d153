"""MXFP4 checkpoints (gpt-oss's experts as shipped), de-quantized at load: the decoder against
transformers' own (``convert_moe_packed_tensors``), and a tiny gpt-oss whose experts are
MXFP4 through the engine against transformers loading the same directory with
``Mxfp4Config(dequantize=True)`` (fp32, greedy tokens and logprobs)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxkv.model import mxfp4  # noqa: E402
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
    got = mxfp4.dequantize_checkpoint({"w_blocks": blocks.numpy(), "w_scales": scales.numpy()},
                                      "test")["w"]
    assert got.shape == want.shape == (3, 96, 40)
    np.testing.assert_array_equal(got, want)


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


def test_mxfp4_gpt_oss_equals_transformers(gpt_oss_mxfp4):
    """jaxkv's engine (hybrid cache, chunked prefill) on the MXFP4 directory gives the greedy
    tokens and logprobs of transformers de-quantizing the same files."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gpt_oss_mxfp4, quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32).eval()
    prompt = transformers.AutoTokenizer.from_pretrained(gpt_oss_mxfp4)(austen_text(3000)).input_ids
    assert_greedy_equals_hf(gpt_oss_mxfp4, hf, prompt[:70], NEW_TOKENS, **ENGINE)


def test_bad_quantized_checkpoints_are_refused(gpt_oss_mxfp4, tmp_path):
    from safetensors.numpy import save_file

    config = json.loads((gpt_oss_mxfp4 / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**config, "quantization_config": {"quant_method": "awq"}}))
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="quantization_config.quant_method='awq' is not supported"):
        load_model_files(tmp_path)
    with pytest.raises(ValueError, match="'w' needs both w_blocks and w_scales"):
        mxfp4.dequantize_checkpoint({"w_blocks": np.zeros((1, 2, 1, 16), np.uint8)}, "test")
    with pytest.raises(ValueError, match="do not match scales"):
        mxfp4.dequantize(np.zeros((2, 1, 16), np.uint8), np.zeros((2, 2), np.uint8))
