"""Prefix caching, forks and beam search end to end on a tiny HF checkpoint: outputs identical
with caching off / hash / radix (greedy, fp32) including partial-block hits and requests that
arrive while their prefix is being prefilled; n samples equal the same samples one by one; beam
search equals a brute-force reference beam search on the HF model's logits."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxkv.engine.beam_search import BeamSearchParams, score  # noqa: E402
from jaxkv import LLM  # noqa: E402
from jaxkv.sample.sampler import SamplingParams  # noqa: E402
from tiny_models import austen_text  # noqa: E402

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=96,
              block_size=8, token_buckets=(16, 64), seq_buckets=(8,), dtype="float32")
GREEDY = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)


@pytest.fixture(scope="module")
def engines(tiny):
    out = {mode: LLM(str(tiny[0]), prefix_caching=mode, **ENGINE)
           for mode in (None, "hash", "radix")}
    yield out
    for engine in out.values():
        engine.close()


def shared_prompts():
    """Token prompts over one 37-token prefix: whole-block, partial-block and exact repeats."""
    text = austen_text(5000)
    ids = [int(t) % 390 + 3 for t in np.frombuffer(text[:300].encode(), np.uint8)]
    prefix = ids[:37]                                 # 4 full blocks of 8 + 5 tokens
    return [prefix + ids[100:110],                    # warms the cache
            prefix + ids[100:103] + ids[200:205],     # diverges inside block 5 (partial hit)
            prefix + ids[100:110],                    # an exact repeat (full hit: last recomputed)
            prefix[:16] + ids[50:60],                 # block-aligned divergence
            ids[120:150]]                             # no shared prefix


def run_all(engine, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in engine.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def test_outputs_identical_with_caching_off_hash_and_radix(engines):
    prompts = shared_prompts()
    results = {}
    for mode, engine in engines.items():
        engine.reset_prefix_cache()
        first = run_all(engine, prompts[:1])          # cache the prefix first
        rest = run_all(engine, prompts[1:])
        results[mode] = first + rest
        stats = engine.stats()
        if mode is None:
            assert stats["prefix_cache_hits"] == 0 and stats["num_cached_blocks"] == 0
        else:
            assert stats["prefix_cache_hit_rate"] > 0 and stats["num_cached_blocks"] > 0
            assert stats["kv_blocks_used"] == 0
        results[mode, "hits"] = stats["prefix_cache_hits"]
    assert results["hash"] == results[None] and results["radix"] == results[None]
    assert results["radix", "hits"] > results["hash", "hits"]


def test_num_cached_tokens_and_reset(engines):
    engine = engines["radix"]
    engine.reset_prefix_cache()
    prompts = shared_prompts()
    (a,) = engine.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    (b,) = engine.generate([{"prompt_token_ids": prompts[1]}], GREEDY, use_tqdm=False)
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 37 + 3               # the prefix and 3 tokens of block 5
    engine.reset_prefix_cache()
    assert engine.stats()["num_cached_blocks"] == 0
    (c,) = engine.generate([{"prompt_token_ids": prompts[1]}], GREEDY, use_tqdm=False)
    assert c.num_cached_tokens == 0 and c.outputs[0].token_ids == b.outputs[0].token_ids


def test_cache_salt_isolates_tenants(engines):
    engine = engines["hash"]
    engine.reset_prefix_cache()
    prompt = [{"prompt_token_ids": shared_prompts()[0]}]
    (a,) = engine.generate(prompt, GREEDY, use_tqdm=False, cache_salt="tenant-a")
    (b,) = engine.generate(prompt, GREEDY, use_tqdm=False, cache_salt="tenant-b")
    (c,) = engine.generate(prompt, GREEDY, use_tqdm=False, cache_salt="tenant-a")
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, 40)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


@pytest.mark.parametrize("mode", [None, "hash", "radix"])
def test_request_arriving_while_its_prefix_is_prefilled(engines, mode):
    engine = engines[mode]
    engine.reset_prefix_cache()
    prompts = shared_prompts()
    long = prompts[0] * 3                              # 141 tokens: 3 chunks of 64
    engine.add_request({"prompt_token_ids": long}, GREEDY, request_id="long")
    engine.step()                                      # first chunk computed
    engine.add_request({"prompt_token_ids": long[:100] + prompts[4]}, GREEDY, request_id="late")
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    ref = run_all(engines[None], [long, long[:100] + prompts[4]])
    assert [outs["long"], outs["late"]] == ref


@pytest.mark.parametrize("mode", [None, "radix"])
def test_parallel_samples_equal_the_same_samples_one_by_one(engines, mode):
    engine = engines[mode]
    prompt = {"prompt_token_ids": shared_prompts()[1]}
    params = SamplingParams(n=4, seed=11, temperature=1.0, max_tokens=8, min_tokens=8)
    (together,) = engine.generate([prompt], params, use_tqdm=False)
    hits = engine.stats()["prefix_cache_hits"]
    for i, comp in enumerate(together.outputs):
        (alone,) = engine.generate([prompt], SamplingParams(seed=11 + i, temperature=1.0,
                                                            max_tokens=8, min_tokens=8),
                                   use_tqdm=False)
        assert alone.outputs[0].token_ids == comp.token_ids
        np.testing.assert_allclose(alone.outputs[0].cumulative_logprob, comp.cumulative_logprob,
                                   rtol=0, atol=1e-4)
    assert hits >= 3 * (len(prompt["prompt_token_ids"]) - 1)   # 3 forks share the prompt


def reference_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0):
    """vLLM's beam search over full HF forward passes (no cache): top 2 * width per beam."""
    beams, finished = [(list(prompt), 0.0)], []
    for step in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].double()
            logprobs = torch.log_softmax(logits, -1).numpy()
            for token in np.argsort(-logprobs, kind="stable")[:2 * width]:
                new = (tokens + [int(token)], cum + float(logprobs[token]))
                if int(token) in eos:
                    finished.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=lambda c: -c[1])
        beams = candidates[:width]
    finished += beams
    finished.sort(key=lambda h: -score(h[0], h[1], eos, length_penalty))
    return finished[:width]


@pytest.mark.parametrize("width", [1, 3])
def test_beam_search_equals_brute_force_reference(tiny, engines, width):
    _, model = tiny
    engine = engines["hash"]
    prompts = shared_prompts()[1:3]
    eos = tuple(engine.tokenizer.eos_token_ids)
    outs = engine.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width=width, max_tokens=5))
    for prompt, out in zip(prompts, outs):
        ref = reference_beam_search(model, prompt, width, 5, eos)
        assert [s.tokens for s in out.sequences] == [t for t, _ in ref]
        np.testing.assert_allclose([s.cum_logprob for s in out.sequences],
                                   [c for _, c in ref], rtol=0, atol=1e-4)
        assert out.sequences[0].text == engine.tokenizer.decode(
            out.sequences[0].tokens[len(prompt):], skip_special_tokens=True)
    assert not engine.has_unfinished_requests()
    assert engine.stats()["kv_blocks_used"] == 0
    engine.engine.check_invariants()


def test_beam_search_rejects_bad_input(engines):
    engine = engines[None]
    with pytest.raises(ValueError, match="beam_width=11"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="beam_width=9 exceeds max_num_seqs=8"):
        engine.beam_search("Emma", BeamSearchParams(beam_width=9, max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens=300"):
        engine.beam_search("Emma", BeamSearchParams(beam_width=2, max_tokens=300))
