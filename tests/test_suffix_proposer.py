"""The suffix proposer (``speculative="suffix"``) against a brute-force count of substrings
over the sequences it should have indexed, through growth, releases and oldest-out eviction;
and the engine on the tiny model: greedy outputs equal non-speculative decoding, and a request
repeating an earlier one drafts from that one's output."""

import random
from collections import Counter

import numpy as np
import pytest

from jaxkv.spec_decode.suffix import SuffixProposer


def brute_force(sequences, context, k, max_depth, min_probability):
    """The module docstring's steps 1-2 with every substring counted by enumeration."""
    counts = Counter(tuple(s[i:j]) for s in sequences for i in range(len(s))
                     for j in range(i + 1, min(i + max_depth, len(s)) + 1))

    def nexts(path):
        return {p[-1]: c for p, c in counts.items() if len(p) == len(path) + 1
                and p[:-1] == path}

    def match(ctx):
        for n in range(min(max_depth - 1, len(ctx)), 0, -1):
            if nexts(tuple(ctx[-n:])):
                return tuple(ctx[-n:])
        return None

    out, probability, path = [], 1.0, None
    while len(out) < k:
        if path is None or len(path) == max_depth:
            path = match(list(context) + out)
            if path is None:
                break
        options = nexts(path)
        if not options:
            break
        token = max(options, key=lambda t: (options[t], -t))
        probability *= options[token] / sum(options.values())
        if probability < min_probability:
            break
        out.append(token)
        path += (token,)
    return tuple(out)


@pytest.mark.parametrize("seed", range(8))
def test_suffix_proposals_equal_a_brute_force_count(seed):
    """Requests grow a few tokens a step, stop (released) and are evicted oldest-out; after
    every step each running request's proposal equals the brute force over the sequences
    that should be indexed (the running ones as they stand, the cached ones)."""
    rng = random.Random(seed)
    vocab, max_depth = rng.choice([2, 3, 5]), rng.choice([2, 3, 6])
    min_probability = rng.choice([0.0, 0.1, 0.4])
    proposer = SuffixProposer(max_depth, cache_tokens=rng.choice([0, 15, 40]),
                              min_probability=min_probability)
    running, cached, next_id = {}, [], 0
    for _ in range(60):
        if len(running) < 3 and rng.random() < 0.5:
            running[next_id] = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            next_id += 1
        for tokens in running.values():
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        k = rng.randint(1, 7)
        got = proposer.propose_batch({i: (np.array(t, np.int32), k) for i, t in running.items()})
        sequences = list(running.values()) + cached
        for i, tokens in running.items():
            assert got[i] == brute_force(sequences, tokens, k, max_depth, min_probability), i
        for i in [i for i in running if rng.random() < 0.2]:
            proposer.release(i)
            cached.append(running.pop(i))
            while sum(map(len, cached)) > proposer.cache_tokens:
                cached.pop(0)
            assert proposer.num_cached_tokens == sum(map(len, cached))
    for i in list(running):
        proposer.release(i)
    if proposer.cache_tokens == 0:
        assert not proposer._root.children   # everything uncounted, every node cut off


def test_suffix_proposer_drafts_from_an_earlier_request():
    """A request whose history repeats another's (now released) drafts that one's
    continuation; a history that is not an extension of the indexed one is indexed afresh."""
    proposer = SuffixProposer(max_depth=8, cache_tokens=100)
    first = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9], np.int32)
    assert proposer.propose_batch({"a": (first, 4)}) == {"a": ()}
    proposer.release("a")
    assert proposer.propose_batch({"b": (first[:3], 4)}) == {"b": (4, 5, 6, 7)}
    assert proposer.propose_batch({"b": (np.array([9, 9, 2], np.int32), 2)}) == {"b": (3, 4)}
    assert proposer.num_cached_tokens == 9


# ---------------------------------------------------------------- the engine (tiny model)


def _generate(llm, prompts, params):
    before = llm.stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.stats()
    counts = {key: after[key] - before[key] for key in ("num_steps", "spec_num_draft_tokens",
                                                        "spec_num_accepted_tokens")}
    counts["prompt_tokens"] = sum(len(o.prompt_token_ids) for o in outs)
    return [o.outputs[0].token_ids for o in outs], counts


def test_engine_suffix_keeps_greedy_outputs_and_drafts_from_earlier_requests(tiny, tiny_llm):
    """Greedy outputs with suffix drafts equal non-speculative decoding; a batch repeating
    earlier prompts drafts those requests' outputs (now released to the cache), so nearly all
    its tokens come from accepted drafts and it takes a fraction of the steps; the n-gram
    proposer, which sees each request's own tokens only, does not."""
    from jaxkv import LLM, SamplingParams
    from tiny_models import TINY_ENGINE, austen_prompts

    prompts = austen_prompts(4, seed=21, max_chars=80)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want, plain = _generate(tiny_llm, prompts, params)
    spec = dict(num_speculative_tokens=4, speculative_adaptive=False)
    with LLM(str(tiny[0]), **TINY_ENGINE, speculative="suffix", **spec) as suffix, \
            LLM(str(tiny[0]), **TINY_ENGINE, speculative="ngram", **spec) as ngram:
        first, _ = _generate(suffix, prompts, params)
        again, counts = _generate(suffix, prompts, params)
        assert first == again == want
        generated = sum(map(len, want))
        assert counts["spec_num_accepted_tokens"] >= 0.75 * generated
        assert counts["num_steps"] <= plain["num_steps"] / 3
        # every request is cached as the proposer last saw it: all but its last step's tokens
        # (1 + at most 4 accepted drafts)
        full = 2 * (counts["prompt_tokens"] + generated)
        cached = suffix.engine.speculator.proposer.num_cached_tokens
        assert full - 2 * len(prompts) * 5 <= cached < full
        ngram_tokens, ngram_counts = _generate(ngram, prompts, params)
        assert ngram_tokens == want
        assert ngram_counts["spec_num_accepted_tokens"] < counts["spec_num_accepted_tokens"] / 2
        suffix.engine.check_invariants()
        assert suffix.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_depth=1), "suffix_max_depth"), (dict(cache_tokens=-1), "suffix_cache_tokens"),
    (dict(min_probability=1.5), "suffix_min_probability")])
def test_bad_suffix_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SuffixProposer(**kwargs)
