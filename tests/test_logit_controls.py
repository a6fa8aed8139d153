"""``logit_bias``, ``allowed_token_ids`` and bad words through the engine, against HF
transformers' ``sequence_bias``, ``suppress_tokens`` and ``bad_words_ids`` logits processors on
the same tiny Llama (greedy tokens), with speculative decoding on (the same tokens as off), and
ids outside the vocabulary refused, named, before anything is queued."""

import pytest

torch = pytest.importorskip("torch")

from jaxkv import LLM, SamplingParams  # noqa: E402
from jaxkv.sample.logit_controls import bad_words_token_ids, banned_tokens  # noqa: E402
from tiny_models import TINY_ENGINE, austen_text  # noqa: E402

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llms(tiny):
    """{speculative: LLM} over the tiny Llama: plain, and with n-gram drafts (not adaptive:
    every match is proposed, whatever the acceptance of earlier tests)."""
    path, _ = tiny
    out = {False: LLM(str(path), **TINY_ENGINE),
           True: LLM(str(path), **TINY_ENGINE, speculative="ngram", num_speculative_tokens=3,
                     speculative_adaptive=False)}
    yield out
    for llm in out.values():
        llm.close()


def _prompt(llm):
    # a repetitive text, so n-gram drafts are proposed and accepted
    return llm.tokenizer.encode(austen_text(400) * 3)[:96]


def _hf_greedy(model, prompt, **processors):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None, **processors)
    return out[0, len(prompt):].tolist()


def _greedy(llm, prompt, spec=False, **controls):
    """The greedy tokens; with speculation (``spec``), drafts must have been verified."""
    before = llm.stats()["spec_num_draft_tokens"]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **controls)
    out = list(llm.generate({"prompt_token_ids": prompt}, params,
                            use_tqdm=False)[0].outputs[0].token_ids)
    assert (llm.stats()["spec_num_draft_tokens"] > before) == spec
    return out


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_logit_bias_equals_transformers_sequence_bias(tiny, llms, spec):
    model, llm = tiny[1], llms[spec]
    prompt = _prompt(llm)
    plain = _hf_greedy(model, prompt)
    bias = {plain[0]: -100.0, plain[5]: -7.5, 17: 4.0}
    want = _hf_greedy(model, prompt, sequence_bias={(i,): b for i, b in bias.items()})
    assert want != plain
    assert _greedy(llm, prompt, spec, logit_bias=bias) == want


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_allowed_token_ids_equal_transformers_suppress_tokens(tiny, llms, spec):
    model, llm = tiny[1], llms[spec]
    prompt = _prompt(llm)
    allowed = sorted(set(prompt[10:40]))
    others = [t for t in range(model.config.vocab_size) if t not in allowed]
    want = _hf_greedy(model, prompt, suppress_tokens=others)
    got = _greedy(llm, prompt, spec, allowed_token_ids=allowed)
    assert got == want and set(got) <= set(allowed)


def test_banned_tokens_follow_vllms_rule():
    seqs = [(31,), (5, 63), (7, 8, 9)]
    assert banned_tokens(seqs, []) == {31}
    assert banned_tokens(seqs, [1, 5]) == {31, 63}
    assert banned_tokens(seqs, [7, 8]) == {31, 9}
    assert banned_tokens(seqs, [8, 7]) == {31}


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_bad_words_equal_transformers_bad_words_ids(tiny, llms, spec):
    """A one-token and a two-token sequence banned (the two-token one's first token does not
    end the prompt, where HF, which also reads the prompt, would differ from vLLM's rule)."""
    model, llm = tiny[1], llms[spec]
    prompt = _prompt(llm)
    plain = _hf_greedy(model, prompt)
    bad = [[plain[12]], [plain[16], plain[17]]]
    assert plain[16] != prompt[-1]
    want = _hf_greedy(model, prompt, bad_words_ids=bad)
    assert want != plain
    assert _greedy(llm, prompt, spec, bad_words_token_ids=bad) == want


def test_bad_words_are_tokenized_alone_and_after_a_space(llms):
    """vLLM's rule: the word, and the word after a space where that is other tokens of the
    same count; generating with them never produces either sequence."""
    llm = llms[False]
    tok = llm.tokenizer
    prompt = _prompt(llm)
    text = tok.decode(_greedy(llm, prompt))
    word = max(text.split(), key=len)
    seqs = bad_words_token_ids(tok, [word])
    alone, spaced = tok.encode(word, False), tok.encode(" " + word, False)
    assert seqs == ((tuple(alone), tuple(spaced)) if spaced[0] != alone[0]
                    and len(spaced) == len(alone) else (tuple(alone),))
    got = _greedy(llm, prompt, bad_words=[word])
    assert got == _greedy(llm, prompt, bad_words_token_ids=seqs)
    for q in seqs:
        assert all(tuple(got[i:i + len(q)]) != q for i in range(len(got)))


def test_ids_outside_the_vocabulary_are_refused_before_queueing(llms):
    llm = llms[False]
    vocab = llm.engine.model_config.vocab_size
    for controls, field in ((dict(logit_bias={vocab: 1.0}), "logit_bias"),
                            (dict(allowed_token_ids=[1, vocab]), "allowed_token_ids"),
                            (dict(bad_words_token_ids=[[3], [vocab]]),
                             r"bad_words_token_ids\[1\]")):
        with pytest.raises(ValueError, match=f"^{field}="):
            llm.generate("Emma", SamplingParams(max_tokens=2, **controls), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    assert len(_greedy(llm, _prompt(llm))) == NEW_TOKENS   # still serving
