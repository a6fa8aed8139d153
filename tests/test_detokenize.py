"""Incremental detokenization against full decodes: every prefix of random and multi-byte token
streams, a bounded decode window per step, and engine stop strings and streams against a brute-force
search over full decodes (the engine's former per-step algorithm)."""

import dataclasses

import numpy as np
import pytest

from jaxkv.engine.detokenize import IncrementalDetokenizer
from jaxkv.model.tokenizer import Tokenizer
from tiny_models import austen_text, train_bpe

MULTIBYTE = ("Café — naïve façade, déjà vu… 😀🎉 日本語のテキスト 中文 한국어 ÅÄÖ "
             "«quotes» ½ ∑ λ → 🇫🇷 \ufffd end.\n")


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(train_bpe(austen_text(), 400), bos_token_id=1, eos_token_ids=(2,),
                     chat_template=None, special_tokens={})


class CountingTokenizer:
    """Forwards ``decode`` to a tokenizer and records how many ids each call got."""

    def __init__(self, inner):
        self.inner = inner
        self.lengths = []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def check_every_prefix(tokenizer, ids, skip_special_tokens):
    """After each token: text + pending == decode(prefix), deltas build text, text only grows."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    deltas, texts = [], []
    for k in range(1, len(ids) + 1):
        deltas.append(detok.update(ids[:k]))
        full = tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens)
        assert detok.text + detok.pending == full, k
        assert "".join(deltas) == detok.text
        texts.append(detok.text)
    final = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert all(final.startswith(t) for t in texts)
    return detok


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_random_tokens_every_prefix_equals_full_decode(tokenizer, seed, skip_special_tokens):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, tokenizer.vocab_size, size=200).tolist()
    check_every_prefix(tokenizer, ids, skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_multibyte_text_every_prefix_equals_full_decode(tokenizer, skip_special_tokens):
    # Byte-level BPE trained on Austen splits every non-ASCII character across byte tokens.
    ids = tokenizer.encode(MULTIBYTE * 2)
    ids[5:5] = [1]           # a special token in the middle
    assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).count("日本語") == 2
    detok = check_every_prefix(tokenizer, ids, skip_special_tokens)
    assert detok.pending == ""


def test_committed_text_never_ends_in_a_broken_character(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    detok = IncrementalDetokenizer(tokenizer)
    for k in range(1, len(ids) + 1):
        detok.update(ids[:k])
        assert MULTIBYTE.startswith(detok.text)    # valid UTF-8: committed text is exact
    assert detok.text == MULTIBYTE


def test_decoded_tokens_per_step_are_bounded(tokenizer):
    ids = tokenizer.encode(MULTIBYTE * 40)
    assert len(ids) > 2000
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    per_step = []
    for k in range(1, len(ids) + 1):
        before = len(counting.lengths)
        detok.update(ids[:k])
        per_step.append(counting.lengths[before:])
    assert detok.text == MULTIBYTE * 40
    # at most 2 decodes a step, over the <= 4 tokens of a UTF-8 character plus its left context
    assert max(len(calls) for calls in per_step) <= 2
    assert max(counting.lengths) <= 8
    first, last = per_step[:len(ids) // 2], per_step[len(ids) // 2:]
    assert max(map(sum, last)) <= max(map(sum, first))


# ---------------------------------------------------------------- engine


def brute_force_stop(tokenizer, ids, stops, skip_special_tokens=True):
    """The engine's former algorithm: full decode after every token, earliest stop string wins."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens)
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if hits:
            pos, stop = min(hits)
            return ids[:k], text[:pos], stop
    return ids, tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), None


def straddling_stops(tokenizer, ids, rng, count):
    """Substrings of the decoded ``ids`` that start in one token and end in a later one."""
    text = tokenizer.decode(ids)
    cuts = [len(tokenizer.decode(ids[:k])) for k in range(1, len(ids))]
    cuts = [c for c, k in zip(cuts, range(1, len(ids)))
            if 1 <= c < len(text) - 2 and text.startswith(tokenizer.decode(ids[:k]))]
    stops = []
    for c in rng.choice(cuts, size=min(count, len(cuts)), replace=False):
        a, b = int(c) - int(rng.integers(1, 3)), int(c) + int(rng.integers(1, 4))
        stops.append(text[max(0, a):b])
    return stops


@pytest.fixture(scope="module")
def llm(tiny):
    from jaxkv import LLM
    with LLM(str(tiny[0]), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
             num_kv_blocks=64, block_size=8, token_buckets=(16, 64), seq_buckets=(8,)) as engine:
        yield engine


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_engine_stop_strings_match_brute_force(llm, skip_special_tokens):
    from jaxkv.sample.sampler import SamplingParams
    tok = llm.tokenizer
    prompts = ["It was a truth universally", "Emma Woodhouse, handsome, clever",
               "Caf\u00e9 \u2014 \U0001F600", "She had"]
    base_params = [SamplingParams(temperature=t, seed=7 + i, max_tokens=40, ignore_eos=True,
                                  skip_special_tokens=skip_special_tokens)
                   for i, t in enumerate([0.0, 1.0, 1.0, 1.5])]
    base = [o.outputs[0] for o in llm.generate(prompts, base_params, use_tqdm=False)]
    rng = np.random.default_rng(0)
    for prompt, params, out in zip(prompts, base_params, base):
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=skip_special_tokens)
        stop_sets = [[s] for s in straddling_stops(tok, out.token_ids, rng, 4)]
        stop_sets.append([s for ss in stop_sets for s in ss] + ["never appears \u2603"])
        for stops in stop_sets:
            want_ids, want_text, want_stop = brute_force_stop(
                tok, out.token_ids, stops, skip_special_tokens)
            sp = dataclasses.replace(params, stop=stops)
            got = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.text, got.stop_reason) == (want_ids, want_text, want_stop)
            assert got.finish_reason == ("stop" if want_stop else "length")
            # a stream's texts only grow and end at the final text
            texts = [o.outputs[0].text for o in llm.stream(prompt, sp)]
            assert texts[-1] == want_text
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_engine_stream_deltas_concatenate_to_final_text(llm):
    from jaxkv.sample.sampler import SamplingParams
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=50, ignore_eos=True)
        outs = list(llm.stream("Caf\u00e9 \u2014 \u65e5\u672c", params))
        final = outs[-1].outputs[0]
        deltas, seen = [], ""
        for o in outs:
            text = o.outputs[0].text
            assert text.startswith(seen)
            deltas.append(text[len(seen):])
            seen = text
        assert "".join(deltas) == final.text == llm.tokenizer.decode(final.token_ids)
