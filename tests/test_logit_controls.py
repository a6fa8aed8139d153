"""``logit_bias`` and ``allowed_token_ids`` through the engine, against HF transformers'
``sequence_bias`` and ``suppress_tokens`` logits processors on the same tiny Llama (greedy
tokens), with speculative decoding on (the same tokens as off), and ids outside the
vocabulary refused, named, before anything is queued."""

import pytest

torch = pytest.importorskip("torch")

from jaxkv import LLM, SamplingParams  # noqa: E402
from tiny_models import TINY_ENGINE, austen_text  # noqa: E402

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llms(tiny):
    """{speculative: LLM} over the tiny Llama: plain, and with n-gram drafts."""
    path, _ = tiny
    out = {False: LLM(str(path), **TINY_ENGINE),
           True: LLM(str(path), **TINY_ENGINE, speculative="ngram", num_speculative_tokens=3)}
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


def test_ids_outside_the_vocabulary_are_refused_before_queueing(llms):
    llm = llms[False]
    vocab = llm.engine.model_config.vocab_size
    for controls, field in ((dict(logit_bias={vocab: 1.0}), "logit_bias"),
                            (dict(allowed_token_ids=[1, vocab]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=f"^{field}="):
            llm.generate("Emma", SamplingParams(max_tokens=2, **controls), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    assert len(_greedy(llm, _prompt(llm))) == NEW_TOKENS   # still serving
