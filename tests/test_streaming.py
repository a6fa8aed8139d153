"""StreamingLLM retention through the engine, against an independent float64 numpy oracle of the
tiny Llama (weights from its transformers checkpoint) that attends, per query, to exactly the
sinks and the window, with RoPE at the positions each mode defines:

* ``original``: every token at its position in the text (a banded + sinks causal mask);
* ``cache``: StreamingLLM's numbering, recomputed from scratch for every query: the keys it sees
  are laid out as ``[sinks | window]`` and numbered 0, 1, ... in that order, the query last.
  The engine gets there another way (keys rotated once at their original positions, sinks
  rescored with a query rotated to ``min(p, S + W - 1)``, jaxkv/retention/streaming.py), so
  agreement checks that identity end to end.

Sequences run past the tiny model's context (512) in a pool far smaller than the sequence, with
every KV format the grouped and reference paths read, prefix caching and forks."""

import numpy as np
import pytest

import jax.numpy as jnp

from jaxkv import LLM, SamplingParams
from jaxkv.retention import StreamingRetention
from numpy_llama import attend_heads, llama_logprobs
from tiny_models import TINY_ENGINE

SINKS, WINDOW = 4, 28
STREAM = dict(TINY_ENGINE, max_model_len=1200, num_kv_blocks=40, kv_retention="streaming",
              kv_sink_tokens=SINKS, kv_window_tokens=WINDOW)


def oracle_logprobs(model, tokens, positions):
    """float64 log-softmax [T, V] of the tiny Llama where query t attends to the keys
    ``visible(t)`` (sinks + window) at the positions ``positions`` gives for them."""

    def attend(t, q, k, v, rope):
        keys = np.array([j for j in range(t + 1) if j < SINKS or t - j < WINDOW])
        q_pos, k_pos = positions(t, keys)
        return attend_heads(rope(q[t], q_pos), rope(k[keys], np.asarray(k_pos)[:, None]),
                            v[keys], np.arange(len(keys)))

    return llama_logprobs(model, tokens, attend)


POSITIONS = {
    "original": lambda t, keys: (t, keys),
    "cache": lambda t, keys: (len(keys) - 1, np.arange(len(keys))),
}


def _generate(engine, prompts, max_tokens, n=1):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                            n=n)
    return engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("positions", ["cache", "original"])
def test_streaming_equals_the_oracle_past_the_context(tiny, positions):
    path, model = tiny
    prompts = [list(range(5, 45)), list(range(100, 113))]
    with LLM(str(path), **STREAM, kv_positions=positions) as engine:
        outs = _generate(engine, prompts, 560)   # 600 / 573 tokens: past the 512 context
        usage = engine.stats()["kv_cache_usage"] if "kv_cache_usage" in engine.stats() else None
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        tokens = prompt + list(comp.token_ids)
        ref = oracle_logprobs(model, tokens[:-1], POSITIONS[positions])      # [T - 1, V]
        got = np.array([lp[t] for t, lp in zip(comp.token_ids, comp.logprobs)])
        want = ref[np.arange(len(prompt) - 1, len(tokens) - 1), comp.token_ids]
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
        # greedy: each chosen token is the oracle's argmax, unless a near-tie
        best = ref[len(prompt) - 1:].max(-1)
        assert np.all(want >= best - 1e-4)
    assert usage is None or usage <= 1.0


def test_the_two_position_modes_differ_past_the_window(tiny):
    path, model = tiny
    tokens = list(range(5, 45)) + list(range(200, 260))
    a = oracle_logprobs(model, tokens, POSITIONS["cache"])
    b = oracle_logprobs(model, tokens, POSITIONS["original"])
    np.testing.assert_allclose(a[:SINKS + WINDOW], b[:SINKS + WINDOW], atol=1e-9)
    assert np.abs(a[SINKS + WINDOW:] - b[SINKS + WINDOW:]).max() > 1e-3


@pytest.mark.parametrize("kv_cache_dtype, residual", [
    pytest.param("int8", 1, marks=pytest.mark.slow), ("int4", 1),
    pytest.param("int4", 3, marks=pytest.mark.slow)])
def test_quantized_streaming_grouped_equals_the_reference(tiny, kv_cache_dtype, residual):
    # the KIVI residual window (R blocks) lies inside the streaming window; dropped blocks
    # never own a residual slot, and both implementations read the same pool the same way
    path, _ = tiny
    prompts = [list(range(5, 45)), list(range(100, 113))]
    kw = dict(STREAM, kv_cache_dtype=kv_cache_dtype, kv_residual_blocks=residual)
    runs = []
    for impl in ("grouped", "reference"):
        with LLM(str(path), **kw, attention_impl=impl) as engine:
            outs = _generate(engine, prompts, 400)
            engine.engine.check_invariants()
            runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]
    assert all(len(t) == 400 for t in runs[0])


def test_streaming_with_prefix_caching_forks_and_the_reference_impl(tiny):
    path, _ = tiny
    prompt = list(range(5, 75))                       # 70 tokens: longer than sinks + window
    with LLM(str(path), **STREAM, prefix_caching="hash") as engine:
        first = _generate(engine, [prompt], 100)[0].outputs[0]
        again = _generate(engine, [prompt], 100)[0]   # hits the cached prompt blocks
        forks = _generate(engine, [prompt], 100, n=2)[0].outputs
        engine.engine.check_invariants()
        assert engine.stats()["prefix_cache_hit_rate"] > 0
    assert again.outputs[0].token_ids == first.token_ids
    assert [f.token_ids for f in forks] == [first.token_ids] * 2
    with LLM(str(path), **STREAM, attention_impl="reference") as engine:
        assert _generate(engine, [prompt], 100)[0].outputs[0].token_ids == first.token_ids


def test_window_covering_the_sequence_equals_full_retention(tiny):
    path, _ = tiny
    prompts = [list(range(5, 45)), list(range(100, 113))]
    with LLM(str(path), **TINY_ENGINE) as engine:
        full = [o.outputs[0].token_ids for o in _generate(engine, prompts, 150)]
    with LLM(str(path), **dict(TINY_ENGINE, kv_retention="streaming",
                               kv_window_tokens=256)) as engine:
        assert [o.outputs[0].token_ids for o in _generate(engine, prompts, 150)] == full


def test_bad_streaming_arguments_fail_before_loading(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="kv_window_tokens"):
        LLM(str(path), **dict(TINY_ENGINE, kv_retention="streaming"))
    with pytest.raises(ValueError, match="max_model_len=600"):
        LLM(str(path), **dict(TINY_ENGINE, max_model_len=600))   # past the context, no policy
    with pytest.raises(ValueError, match="KIVI residual"):
        LLM(str(path), **dict(STREAM, kv_cache_dtype="int4", kv_window_tokens=4))


# ---- the attention contract: sink queries ---------------------------------------------------

def _sink_batch(seed=0, *, bs=4, Hkv=2, G=2, D=16, num_blocks=48):
    """A ragged batch (a prefill chunk after a cached prefix, decodes, a whole prompt, padding)
    with null blocks where streaming would have dropped them, and random q, sink q, pools."""
    from bench.lib.ragged_batches import table_batch

    rng = np.random.default_rng(seed)
    q_lens, kv_lens = [5, 1, 9, 1], [30, 17, 9, 41]
    tables, lens, qsl = table_batch(rng, q_lens, kv_lens, T=20, S=5, max_blocks=12,
                                    num_blocks=num_blocks, bs=bs)
    tables = np.asarray(tables).copy()
    for s, (q, n) in enumerate(zip(q_lens, kv_lens)):   # drop what no query of s sees
        first, stop = StreamingRetention(sink_tokens=3, window_tokens=6).droppable(n - q, bs)
        tables[s, first:stop] = 0
    q, qs = (jnp.asarray(rng.normal(size=(20, Hkv * G, D)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(num_blocks, bs, Hkv, D)), jnp.float32)
            for _ in range(2))
    # the null block holds whatever padding wrote; large values show any read that is not masked
    k, v = k.at[0].set(300.0), v.at[0].set(1e4)
    return q, qs, k, v, jnp.asarray(tables), lens, qsl


def test_sink_queries_score_only_the_sinks():
    from jaxkv.attention.reference import paged_attention_reference, token_layout

    q, qs, k, v, tables, lens, qsl = _sink_batch()
    out = np.asarray(paged_attention_reference(q, k, v, tables, lens, qsl, sliding_window=6,
                                               num_sinks=3, q_sinks=qs))
    seq_idx, q_pos, valid = (np.asarray(a) for a in token_layout(qsl, lens, 20))
    kk, vv = np.asarray(k), np.asarray(v)
    for t in np.flatnonzero(valid):
        s, p = seq_idx[t], q_pos[t]
        keys = [j for j in range(p + 1) if j < 3 or p - j < 6]
        blocks = np.asarray(tables)[s, [j // 4 for j in keys]]
        kj = kk[blocks, [j % 4 for j in keys]]                      # [n, Hkv, D]
        vj = vv[blocks, [j % 4 for j in keys]]
        for h in range(4):
            query = np.where(np.array(keys)[:, None] < 3, np.asarray(qs)[t, h],
                             np.asarray(q)[t, h])                    # [n, D]
            sc = np.sum(query * kj[:, h // 2], -1) / 4.0
            w = np.exp(sc - sc.max())
            np.testing.assert_allclose(out[t, h], (w / w.sum()) @ vj[:, h // 2], atol=1e-5)


@pytest.mark.parametrize("impl", ["grouped", "pallas"])
def test_sink_queries_in_every_implementation(impl):
    from jaxkv.attention.dispatch import paged_attention
    from jaxkv.attention.pallas import paged_decode_attention
    from jaxkv.attention.reference import paged_attention_reference

    q, qs, k, v, tables, lens, qsl = _sink_batch(seed=1)
    opts = dict(sliding_window=6, num_sinks=3, q_sinks=qs)
    want = paged_attention_reference(q, k, v, tables, lens, qsl, **opts)
    extra = dict(interpret=True) if impl == "pallas" else dict(block_q=4)
    got = paged_attention(q, k, v, tables, lens, qsl, impl=impl, **opts, **extra)
    n = int(qsl[-1])
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], atol=2e-5)
    if impl == "pallas":   # the split-K decode kernel, one token per sequence
        last = np.asarray(qsl[1:5]) - 1
        dec = paged_decode_attention(q[last], k, v, tables[:4], lens[:4], sliding_window=6,
                                     num_sinks=3, q_sinks=qs[last], interpret=True, num_splits=2)
        np.testing.assert_allclose(np.asarray(dec), np.asarray(want)[last], atol=2e-5)


# ---- jaxkv.entrypoints.eval.retained_nll: the perplexity protocol of bench/streaming.py -----------------

@pytest.mark.parametrize("positions", ["cache", "original"])
def test_retained_nll_equals_the_oracle_in_a_bounded_pool(tiny, positions):
    from jaxkv.entrypoints.eval import retained_nll

    path, model = tiny
    ids = np.random.default_rng(3).integers(3, 400, size=700)          # past the 512 context
    policy = StreamingRetention(sink_tokens=SINKS, window_tokens=WINDOW, positions=positions)
    with LLM(str(path), **STREAM) as engine:
        res = retained_nll(engine.engine.runner, ids, retention=policy, kv_cache_dtype="fp32",
                           chunk=32)
    ref = oracle_logprobs(model, list(ids[:-1]), POSITIONS[positions])
    np.testing.assert_allclose(res.nll, -ref[np.arange(699), ids[1:]], atol=2e-4, rtol=1e-4)
    assert res.peak_blocks <= res.pool_blocks == policy.max_blocks(699, 32, 8) < 699 // 8


def test_retained_nll_with_full_retention_is_perplexity(tiny):
    from jaxkv.entrypoints.eval import perplexity, retained_nll
    from jaxkv.retention import FullRetention

    path, _ = tiny
    ids = np.random.default_rng(4).integers(3, 400, size=257)
    with LLM(str(path), **TINY_ENGINE) as engine:
        runner = engine.engine.runner
        res = retained_nll(runner, ids, retention=FullRetention(), kv_cache_dtype="fp32",
                           chunk=64)
        ppl = perplexity(runner, ids, kv_cache_dtype="fp32", context=256, chunk=64)
    assert ppl.num_scored == len(res.nll) == 256
    np.testing.assert_allclose(res.nll.mean(), ppl.nll, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "grouped", "pallas"])
def test_dropped_blocks_are_invisible_in_every_implementation(impl):
    # drops anywhere (not only where a window ends: H2O-style), no window: each query sees its
    # causal prefix minus the dropped blocks; the null block holds large garbage
    from jaxkv.attention.dispatch import paged_attention
    from jaxkv.attention.reference import token_layout
    from bench.lib.ragged_batches import table_batch

    rng = np.random.default_rng(7)
    q_lens, kv_lens = [5, 1, 9, 1], [30, 17, 9, 41]
    tables, lens, qsl = table_batch(rng, q_lens, kv_lens, T=20, S=5, max_blocks=12,
                                    num_blocks=48, bs=4)
    tables = np.asarray(tables).copy()
    for s, (ql, n) in enumerate(zip(q_lens, kv_lens)):
        for j in range((n - ql) // 4):                   # blocks before the step's own writes
            if rng.random() < 0.4:
                tables[s, j] = 0
    q = jnp.asarray(rng.normal(size=(20, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(48, 4, 2, 16)), jnp.float32).at[0].set(300.0)
            for _ in range(2))
    extra = {"pallas": dict(interpret=True), "grouped": dict(block_q=4)}.get(impl, {})
    out = np.asarray(paged_attention(q, k, v, jnp.asarray(tables), lens, qsl, impl=impl,
                                     **extra))
    seq_idx, q_pos, valid = (np.asarray(a) for a in token_layout(qsl, lens, 20))
    kk, vv = np.asarray(k), np.asarray(v)
    for t in np.flatnonzero(valid):
        s, p = seq_idx[t], q_pos[t]
        keys = [j for j in range(p + 1) if tables[s, j // 4] != 0]
        blocks = tables[s, [j // 4 for j in keys]]
        kj, vj = kk[blocks, [j % 4 for j in keys]], vv[blocks, [j % 4 for j in keys]]
        for h in range(4):
            sc = kj[:, h // 2] @ np.asarray(q)[t, h] / 4.0
            w = np.exp(sc - sc.max())
            np.testing.assert_allclose(out[t, h], (w / w.sum()) @ vj[:, h // 2], atol=2e-5)
