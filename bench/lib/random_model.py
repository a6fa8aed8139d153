"""HF Llama directories of random weights with a word-level tokenizer (every id decodes).

* ``write_random_model``: numpy, safetensors and tokenizers alone (no torch, no network): the
  engine rows of bench/gpu_check.py, at SmolLM2-135M's geometry (the real checkpoint cannot travel
  to the GPU machine).
* ``write_tiny_llama``: the tiny Llama whose weights transformers draws at a torch seed, the
  weights of tests/tiny_models.py's ``save_tiny_model(path, "llama")``: bench/prefix_cache.py's
  ``sharing`` scenario (beam search's peak block count depends on the tokens, so on the weights).
"""

from __future__ import annotations

import json
import os

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")   # ids 0, 1 (bos), 2 (eos)


def write_random_model(path: str, sizes: dict, *, seed: int = 0, std: float = 0.02) -> str:
    """An HF Llama directory of random weights, SmolLM2-135M's config with ``sizes``' fields.

    config.json (silu, rms_norm_eps 1e-5, rope_theta 100000, tied embeddings, bos 1, eos 2; a
    field of ``sizes`` overrides any of these, e.g. ``tie_word_embeddings=False``);
    model.safetensors of bf16 weights drawn as ``jaxkv.model.llama.init_params`` draws them
    (matrices normal(0, std), RMSNorm weights 1) under the names ``weights.expected_shapes``
    lists; a word-level tokenizer over the whole vocabulary, so every id a random model samples
    decodes. Written with numpy, safetensors and tokenizers alone (the GPU machine reaches no
    network, and the real checkpoint is too large to travel).
    """
    import ml_dtypes
    from safetensors.numpy import save_file

    from jaxkv.model.config import ModelConfig
    from jaxkv.model.weights import expected_shapes

    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                  max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                  tie_word_embeddings=True, attention_bias=False, bos_token_id=1,
                  eos_token_id=2, torch_dtype="bfloat16") | sizes
    os.makedirs(path, exist_ok=True)
    _dump(path, "config.json", config)
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    save_file({name: np.ones(shape, bf16) if name.endswith("norm.weight")
               else (std * rng.standard_normal(shape, np.float32)).astype(bf16)
               for name, shape in expected_shapes(ModelConfig.from_hf_dict(config)).items()},
              os.path.join(path, "model.safetensors"))
    write_tokenizer(path, sizes["vocab_size"])
    return path


def write_tokenizer(path: str, vocab_size: int) -> str:
    """tokenizer.json (word level: the special tokens, then ``t3`` .. ``t{vocab_size - 1}``),
    tokenizer_config.json and generation_config.json (bos 1, eos 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab |= {f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(os.path.join(path, "tokenizer.json"))
    _dump(path, "tokenizer_config.json", dict(
        bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2], unk_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0]))
    _dump(path, "generation_config.json", dict(bos_token_id=1, eos_token_id=2))
    return path


def write_tiny_llama(path: str, *, seed: int = 0) -> str:
    """A 2-layer Llama (vocab 400, hidden 64, 4 q / 2 kv heads), fp32 weights drawn by
    transformers after ``torch.manual_seed(seed)`` (initializer_range 0.2), and
    ``write_tokenizer``'s vocabulary."""
    import torch
    import transformers

    write_tokenizer(path, 400)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=[2, 0],
        attn_implementation="eager")
    transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(path)
    return path


def _dump(path: str, name: str, obj: dict) -> None:
    with open(os.path.join(path, name), "w") as f:
        json.dump(obj, f, indent=1)
