"""Tiny HF checkpoints written by transformers itself (the parity oracle), with a trained tokenizer.

torch and transformers are imported inside the writers, so torch-free tests can use ``train_bpe``.

``save_tokenizer`` trains a small byte-level BPE (SmolLM2-style pre-tokenizer) on Austen text and
saves it as an HF tokenizer directory; ``save_tiny_model`` writes a random tiny Llama / Qwen2 /
Mistral beside it, so ``jaxkv.LLM(model=dir)`` and ``transformers`` load the very same files.
"""

from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxkv.data import austen

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EOS_IDS = [2, 0]
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig",
                  "qwen3": "Qwen3Config", "mixtral": "MixtralConfig",
                  "qwen3_moe": "Qwen3MoeConfig", "gemma2": "Gemma2Config",
                  "gemma3_text": "Gemma3TextConfig", "gpt_oss": "GptOssConfig",
                  "deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config"}


# Engine limits for the tiny model: small buckets (fast compiles) and a pool that holds the batch.
TINY_ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=96,
                   block_size=8, token_buckets=(16, 64), seq_buckets=(8,))


def austen_text(n_chars=20_000, book="emma"):
    return austen(book)[:n_chars]


def austen_prompts(n, seed=0, max_chars=300):
    """``n`` prompts of 5 .. ``max_chars`` characters cut from Emma at random (seeded)."""
    import numpy as np

    text = austen_text(30_000)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(text) - max_chars - 100, size=n)
    lens = rng.integers(5, max_chars, size=n)
    return [text[s:s + k] for s, k in zip(starts, lens)]


def train_bpe(text, vocab_size=400):
    """A small byte-level BPE (SmolLM2-style pre-tokenizer) trained on ``text``."""
    tok = HFBackend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator([text], trainer=trainer)
    return tok


def save_tokenizer(path, text=None, vocab_size=400):
    """Writes tokenizer.json, tokenizer_config.json (chat template) and generation_config.json."""
    import transformers

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(text or austen_text(), vocab_size), bos_token="<|im_start|>",
        eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=EOS_IDS).save_pretrained(path)
    return path


def save_tiny_model(path, kind="llama", *, seed=0, dtype=None, **overrides):
    """Writes config.json + model.safetensors of a random tiny model; returns the torch model."""
    import torch
    import transformers

    fields = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=EOS_IDS)
    torch.manual_seed(seed)
    config = getattr(transformers, CONFIG_CLASSES[kind])(**{**fields, **overrides},
                                                         attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype or torch.float32).eval()
    model.save_pretrained(path)
    return model


def hf_reference(model, prompt_ids, num_tokens):
    """(greedy tokens, the chosen tokens' logprobs) of HF generate + one full forward."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=num_tokens,
                             do_sample=False, pad_token_id=0)[0]
        logits = model(out[None]).logits[0, len(prompt_ids) - 1:-1].double()
    tokens = out[len(prompt_ids):]
    logprobs = torch.log_softmax(logits, -1)[torch.arange(num_tokens), tokens]
    return tokens.tolist(), logprobs.numpy()


def assert_greedy_equals_hf(model_path, hf, prompt, num_tokens, atol=1e-4, **engine):
    """jaxkv's engine on ``model_path`` and the torch model ``hf`` generate the same greedy
    ``num_tokens`` after ``prompt`` (token ids), with per-token logprobs within ``atol``."""
    import numpy as np
    import torch

    from jaxkv import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    with LLM(str(model_path), **engine) as llm:
        got = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0]
        logits = hf(out[None]).logits[0, len(prompt) - 1:-1].double()
    want = out[len(prompt):]
    assert got.token_ids == want.tolist()
    want_logprobs = torch.log_softmax(logits, -1)[torch.arange(num_tokens), want].numpy()
    np.testing.assert_allclose([lp[t] for lp, t in zip(got.logprobs, got.token_ids)],
                               want_logprobs, atol=atol, rtol=0)
