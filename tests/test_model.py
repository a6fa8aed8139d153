"""Token-exact greedy parity with HF transformers (torch, fp32, CPU) and paged-cache consistency."""

import json

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jaxkv.model.config import ModelConfig
from jaxkv.model.llama import init_params, params_from_hf
from jaxkv.data import austen
from paged_runner import PagedRunner

try:  # the HF oracle (test extra; not installed on the Python 3.12 CI leg)
    import torch
    import transformers
except ImportError:
    torch = transformers = None
needs_hf = pytest.mark.skipif(torch is None, reason="HF transformers + torch (the parity oracle) not installed")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False)

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(TINY)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        TINY, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                high_freq_factor=4.0, original_max_position_embeddings=32),
        rope_theta=500000.0, tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(TINY, num_key_value_heads=4)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(TINY, sliding_window=8)),
    # q/k norms per head; head_dim 32 != hidden / heads (16), as Qwen3-0.6B's 128 != 64
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(TINY, head_dim=32)),
    # a sliding (window 8 < the 52 tokens) and a full layer; scale from query_pre_attn_scalar,
    # soft-caps small enough to bite, head_dim 32 != hidden / heads
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        TINY, num_hidden_layers=3, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True)),
    # 5 sliding : 1 full (+ a sliding 7th), Gemma q/k norms, local RoPE base 1e4 and a
    # linearly scaled global one
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        TINY, num_hidden_layers=7, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
        tie_word_embeddings=True, rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
            sliding_attention=dict(rope_type="default", rope_theta=1e4)))),
    # 8 experts, top 2: a decode token uses 2, a prefill chunk of 7 at most 14 rows of 8
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        TINY, num_local_experts=8, num_experts_per_tok=2)),
    # Qwen3's attention; layer 1 dense (mlp_only_layers), the router's top 3 not renormalised
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        TINY, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
        mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe_norm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True)),
}

MOE = ("mixtral", "qwen3_moe", "qwen3_moe_norm")


def random_model(**overrides):
    fields = dict(architecture="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16)
    config = ModelConfig(**{**fields, **overrides})
    return config, init_params(config, jax.random.PRNGKey(0), std=0.2)


def hf_model(case, tmp_path):
    cfg_cls, model_cls, kwargs = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**kwargs, attn_implementation="eager")
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():    # norm weights away from HF's init (ones), so each is checked
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    model.save_pretrained(tmp_path)
    return model, tmp_path


def jax_params(model, path):
    """The config and params jaxkv reads from the files HF wrote (its on-disk names: HF's
    in-memory ones fuse the experts)."""
    from safetensors.numpy import load_file

    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    return config, params_from_hf(config, load_file(path / "model.safetensors"), jnp.float32)


def test_layers_are_traced_once_per_step_shape(monkeypatch):
    """The decoder layers share one traced body (llama._traced_once): tracing a 4-layer forward
    runs the layer's Python once, not once per layer (start-up time), and the output is the
    unrolled layers' (each layer's own weights are used: a model whose layers are all the same
    differs from this one). The shared trace lives for one trace of the model only, so a
    second runner traces again (what a layer decides at trace time is not carried over)."""
    from jaxkv.model import llama
    config, params = random_model(num_layers=4)
    calls = []
    real = llama.Attention.__call__
    monkeypatch.setattr(llama.Attention, "__call__",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    prompt = list(np.random.default_rng(5).integers(0, 256, size=11))
    out = PagedRunner(params, config, block_size=8, seed=1).prefill(prompt)
    assert len(calls) == 1
    same = dict(params, layers={i: params["layers"][0] for i in params["layers"]})
    other = PagedRunner(same, config, block_size=8, seed=1).prefill(prompt)
    assert len(calls) == 2
    assert np.abs(out - other).max() > 1e-3


@needs_hf
@pytest.mark.parametrize("case,impl", [   # the MoE cases' attention is a dense one's
    (c, i) for c in CASES for i in ("reference", "grouped") if i == "grouped" or c not in MOE])
def test_greedy_parity_with_transformers(case, impl, tmp_path):
    model, path = hf_model(case, tmp_path)
    config, params = jax_params(model, path)
    if case == "mistral":
        assert config.sliding_window == 8
    prompt = list(np.random.default_rng(1).integers(3, 256, size=20))
    model.generation_config.eos_token_id = None     # plain argmax, as PagedRunner.greedy
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                            pad_token_id=0)[0, len(prompt):].tolist()
        full = torch.tensor([prompt + hf])
        hf_logits = model(full).logits[0].numpy()
    runner = PagedRunner(params, config, block_size=4, max_len=64, attention_impl=impl)
    ours, step_logits = runner.greedy(prompt, 32, chunk=7)
    diff = np.abs(step_logits - hf_logits[len(prompt) - 1:-1]).max()
    print(f"{case}: max |logit diff| vs HF over 32 greedy steps = {diff:.3e}")
    assert ours == hf
    np.testing.assert_allclose(step_logits, hf_logits[len(prompt) - 1:-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_equals_one_shot(chunk):
    config, params = random_model(attention_bias=True)
    prompt = list(np.random.default_rng(2).integers(0, 256, size=37))
    one = PagedRunner(params, config, block_size=8, seed=1).prefill(prompt)
    chunked = PagedRunner(params, config, block_size=8, seed=2).prefill(prompt, chunk=chunk)
    np.testing.assert_allclose(chunked, one, atol=2e-5, rtol=2e-5)


def test_paged_decode_equals_full_forward_without_cache():
    """Decoding token by token over the paged cache = one no-cache forward of the whole text."""
    config, params = random_model(architecture="mistral", sliding_window=8)
    tokens = list(np.random.default_rng(3).integers(0, 256, size=30))
    runner = PagedRunner(params, config, block_size=4, seed=3)
    stepwise = np.concatenate([runner.feed([t]) for t in tokens])
    # "without a cache": a fresh pool per call holding only this call's tokens (one shot)
    full = PagedRunner(params, config, block_size=64, seed=4).prefill(tokens)
    np.testing.assert_allclose(stepwise, full, atol=2e-5, rtol=2e-5)
    assert runner.cache.k[0].shape[0] > len(tokens) // 4   # the pool really is paged


@pytest.mark.parametrize("arch,fields,window", [
    ("mistral", dict(sliding_window=16), 16),
    ("mistral", dict(sliding_window=None), None),
    ("qwen3", dict(sliding_window=16), None),                          # use_sliding_window unset
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), 16),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=4), None),
    ("qwen3", dict(layer_types=["full_attention"] * 4, max_window_layers=28), None),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),
     "max_window_layers=2"),
    ("qwen3", dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2),
     "layer_types=\\['sliding_attention'"),
    ("gemma2", dict(sliding_window=16), (16, ("sliding_attention", "full_attention") * 2)),
    ("gemma3_text", dict(sliding_window=16, num_hidden_layers=7),
     (16, ("sliding_attention",) * 5 + ("full_attention", "sliding_attention"))),
    ("gemma3_text", dict(sliding_window=16, sliding_window_pattern=2),
     (16, ("sliding_attention", "full_attention") * 2)),
])
def test_config_json_sliding_window_per_architecture(arch, fields, window):
    """config.json's sliding window as HF applies it (Mistral: always; Qwen2/3: with
    use_sliding_window, from layer max_window_layers on; layer_types where given; Gemma 2/3
    without layer_types: every 2nd / 6th (sliding_window_pattern) layer full); a model other
    than Gemma mixing window and full layers is refused naming the fields."""
    cfg = dict(dict(model_type=arch, hidden_size=64, num_attention_heads=4,
                    intermediate_size=128, num_hidden_layers=4, vocab_size=100), **fields)
    if isinstance(window, str):
        with pytest.raises(ValueError, match=f"{window}.*mixes sliding-window and full"):
            ModelConfig.from_hf_dict(cfg)
    elif isinstance(window, tuple):      # Gemma: the window, and which layers have it
        c = ModelConfig.from_hf_dict(cfg)
        assert (c.sliding_window, c.layer_types) == window
    else:
        assert ModelConfig.from_hf_dict(cfg).sliding_window == window


@needs_hf
def test_params_from_hf_names_missing_tensor(tmp_path):
    model, path = hf_model("llama", tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        params_from_hf(config, tensors, source="model.safetensors")


@pytest.fixture(scope="module")
def smollm2():
    from jaxkv.model import store
    from jaxkv.model.weights import load_model_files

    path = store.resolve(store.DEFAULT_MODEL)
    loaded = load_model_files(path)
    return path, loaded, params_from_hf(loaded.config, loaded.tensors, jnp.float32,
                                        source=str(path))


@needs_hf
@pytest.mark.slow
def test_smollm2_gguf_greedy_parity_with_transformers(smollm2):
    """The default real model: HF loads the same GGUF (gguf_file=) and is the oracle, fp32 CPU."""
    path, loaded, params = smollm2
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    text = austen("pride_and_prejudice")[2000:3000]
    prompt = loaded.tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=32,
                           do_sample=False)[0, len(prompt):].tolist()
        hf_logits = hf(torch.tensor([prompt + want])).logits[0].numpy()
    assert len(want) == 32, "HF stopped early: pick a prompt that continues"
    runner = PagedRunner(params, loaded.config, block_size=16, max_len=512)
    ours, step_logits = runner.greedy(prompt, 32, chunk=16)
    diff = np.abs(step_logits - hf_logits[len(prompt) - 1:-1]).max()
    print(f"SmolLM2-135M GGUF: max |logit diff| vs HF over 32 greedy steps = {diff:.3e}; "
          f"text: {loaded.tokenizer.decode(ours)!r}")
    assert ours == want
    np.testing.assert_allclose(step_logits, hf_logits[len(prompt) - 1:-1], atol=2e-3, rtol=0)
