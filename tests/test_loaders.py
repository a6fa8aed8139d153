"""HF-directory loading, the HF tokenizer, and orbax params checkpoints.

The oracle is HF transformers itself: tiny random Llama / Qwen2 / Mistral models are written with
``save_pretrained`` and every tensor we read must equal the torch ``state_dict`` exactly.
"""

import json
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxkv import data
from jaxkv.model import checkpoint, safetensors_loader
from jaxkv.model.config import ModelConfig, RopeScaling
from jaxkv.model.tokenizer import Tokenizer
from jaxkv.model.weights import expected_shapes, load_model_files

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tiny_models import save_tokenizer  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6)
def _hf_config(kind, **overrides):
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config}[kind]
    return cls(**{**TINY, **overrides})


def _save_tiny(path, kind, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind, **overrides))
    model = model.to(dtype)
    model.save_pretrained(path)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def austen():
    return data.austen("emma")[:20_000]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory, austen):
    return save_tokenizer(tmp_path_factory.mktemp("tok"), austen)


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}}),
    ("qwen2", {}),
    ("mistral", {"sliding_window": 16, "head_dim": 16}),
    ("qwen3", {"head_dim": 16}),
])
def test_hf_dir_tensors_and_config_equal_transformers(tmp_path, hf_tokenizer_dir, kind,
                                                      overrides):
    sd = _save_tiny(tmp_path, kind, **overrides)
    for f in hf_tokenizer_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    m = load_model_files(tmp_path)
    hf = _hf_config(kind, **overrides)
    c = m.config
    assert c.architecture == kind
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads,
        getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert c.rms_norm_eps == hf.rms_norm_eps
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    assert c.attention_bias == (kind == "qwen2")
    assert c.qk_norm == (kind == "qwen3")
    assert c.sliding_window == (16 if kind == "mistral" else None)
    if "rope_scaling" in overrides:
        assert c.rope_scaling == RopeScaling(original_max_position_embeddings=64)
    if c.tie_word_embeddings:
        del sd["lm_head.weight"]
    assert set(m.tensors) == set(sd) == set(expected_shapes(c))
    for k, v in sd.items():
        assert m.tensors[k].dtype == np.float32
        np.testing.assert_array_equal(m.tensors[k], v, err_msg=k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hf_dir_half_precision_sharded(tmp_path, hf_tokenizer_dir, dtype):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config("llama")).to(dtype)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    for f in hf_tokenizer_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    assert len(safetensors_loader.safetensors_files(tmp_path)) > 1
    m = load_model_files(str(tmp_path))
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(m.tensors[k], v.float().numpy(), err_msg=k)


def test_hf_tokenizer_matches_transformers(hf_tokenizer_dir, austen):
    ours = Tokenizer.from_hf_dir(hf_tokenizer_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    text = austen[:5000] + " 1815 <|im_end|> naïve café ✓"
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == theirs.encode(text, add_special_tokens=special)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip)
    assert ours.vocab_size == len(theirs)
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.eos_token_ids == (2, 0)  # generation_config's list, then the tokenizer's eos
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Who is Emma?"}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == (
            theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False))
    with pytest.raises(ValueError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_sentencepiece_style_tokenizer_matches_transformers(tmp_path):
    """Llama-2 style: Metaspace pre-tokenizer and byte fallback, built by LlamaTokenizer."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "h": 4, "i": 5, "▁h": 6, "▁hi": 7,
             "e": 8, "l": 9, "o": 10, "▁he": 11}
    vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
    merges = [("▁", "h"), ("▁h", "i"), ("▁h", "e")]
    hf = transformers.LlamaTokenizer(vocab=vocab, merges=merges)
    hf.save_pretrained(tmp_path)
    ours, theirs = Tokenizer.from_hf_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(
        tmp_path)
    for text in ("hi hello", "  hi\n", "héllo ✓</s>", ""):
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))


def test_chat_template_is_sandboxed(hf_tokenizer_dir):
    tok = Tokenizer.from_hf_dir(hf_tokenizer_dir)
    evil = Tokenizer(tok.backend, bos_token_id=None, eos_token_ids=(), special_tokens={},
                     chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template error"):
        evil.apply_chat_template([])


def test_orbax_round_trip_bit_exact(tmp_path):
    rng = np.random.default_rng(0)
    params = {
        "embed": rng.standard_normal((16, 8)).astype(np.float32),
        "layers": {"0": {"w": jax.numpy.asarray(rng.standard_normal((8, 8)),
                                               dtype=jax.numpy.bfloat16),
                         "q": rng.integers(-128, 127, (8, 4), dtype=np.int8)}},
    }
    config = ModelConfig(architecture="llama", vocab_size=16, hidden_size=8, intermediate_size=8,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                         rope_scaling=RopeScaling(), eos_token_ids=(2, 3))
    checkpoint.save_params(tmp_path / "ckpt", params, {"source": "unit"}, config=config)
    with pytest.raises(ValueError, match="already exists"):
        checkpoint.save_params(tmp_path / "ckpt", params)
    restored = checkpoint.restore_params(tmp_path / "ckpt")
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored)):
        assert np.asarray(b).dtype == np.asarray(a).dtype
        np.testing.assert_array_equal(np.asarray(b).view(np.uint8), np.asarray(a).view(np.uint8))
    assert checkpoint.read_config(tmp_path / "ckpt") == config
    assert checkpoint.read_metadata(tmp_path / "ckpt") == {"source": "unit"}

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp", None))
    shardings = jax.tree.map(lambda _: spec, params)
    sharded = checkpoint.restore_params(tmp_path / "ckpt", shardings=shardings)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sharded)):
        assert b.sharding == spec
        np.testing.assert_array_equal(np.asarray(b).view(np.uint8), np.asarray(a).view(np.uint8))


# ---- bad input: every error names the file and the field ----

@pytest.fixture
def tiny_dir(tmp_path, hf_tokenizer_dir):
    _save_tiny(tmp_path, "llama")
    for f in hf_tokenizer_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


def test_missing_config_json(tiny_dir):
    (tiny_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_files(tiny_dir)


def test_unsupported_model_type(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    (tiny_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config.json: model_type='gpt2'.*supported: llama"):
        load_model_files(tiny_dir)


def test_missing_config_field(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    del cfg["intermediate_size"]
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json: required field 'intermediate_size'"):
        load_model_files(tiny_dir)


def test_corrupt_safetensors(tiny_dir):
    file = tiny_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model.safetensors: corrupt data for tensor '"):
        load_model_files(tiny_dir)
    file.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ValueError, match=r"model.safetensors: corrupt safetensors file"):
        load_model_files(tiny_dir)


def test_missing_tensor_and_wrong_shape(tiny_dir):
    file = tiny_dir / "model.safetensors"
    tensors = safetensors_loader.read_safetensors(file)
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, file)
    with pytest.raises(ValueError, match=f"tensor '{name}' is missing"):
        load_model_files(tiny_dir)
    save_file({**tensors, name: tensors[name][:-1]}, file)
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \(47, 32\), config implies"):
        load_model_files(tiny_dir)


def test_unsupported_safetensors_dtype(tiny_dir):
    file = tiny_dir / "model.safetensors"
    tensors = safetensors_loader.read_safetensors(file)
    save_file({**tensors, "model.norm.weight": tensors["model.norm.weight"].astype(np.float64)},
              file)
    with pytest.raises(ValueError,
                       match="'model.norm.weight' has dtype F64.*supported: F32, F16, BF16"):
        load_model_files(tiny_dir)


def test_missing_tokenizer_and_weights(tiny_dir):
    (tiny_dir / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model_files(tiny_dir)
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model_files(tiny_dir)


def test_unknown_name_lists_store():
    with pytest.raises(ValueError, match="store names: SmolLM2-135M-Instruct"):
        load_model_files("no-such-model")


def test_bf16_reader_matches_ml_dtypes(tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    torch_file = tmp_path / "t.safetensors"
    from safetensors.torch import save_file as torch_save
    torch_save({"x": torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)}, torch_file)
    np.testing.assert_array_equal(safetensors_loader.read_safetensors(torch_file)["x"],
                                  x.astype(np.float32))


def test_hf_dir_loads_without_the_gguf_package(tiny_dir):
    # the GPU image lacks `gguf`: bench/gpu_check.py's engine rows load an HF dir without it
    import subprocess
    import sys
    code = ("import sys; sys.modules['gguf'] = None\n"
            "import jaxkv\n"
            "from jaxkv.model.weights import load_model_files\n"
            f"m = load_model_files({str(tiny_dir)!r})\n"
            "print(m.config.num_layers, 'gguf' in sys.modules and sys.modules['gguf'] is not None)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [str(load_model_files(tiny_dir).config.num_layers), "False"]
