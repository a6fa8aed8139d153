"""SamplingParams validation and the jitted sampler against independent numpy references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.sample.logit_controls import pack_bitmask
from jaxkv.sample.sampler import SamplingParams, SamplingTensors, process_logits, sample

V = 64


def _tensors(params, vocab_size=V, prompts=None, outputs=None, **kw):
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingTensors.from_params(params, vocab_size=vocab_size, prompt_token_ids=prompts,
                                       output_token_ids=outputs, **kw)


# ---------------------------------------------------------------- numpy references (float64)

def _softmax(x):
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def ref_penalties(logits, prompt, output, rep, presence, frequency):
    """vLLM's apply_penalties for one row."""
    out = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output, int), minlength=len(out))
    seen = np.zeros(len(out), bool)
    seen[list(prompt) + list(output)] = True
    out[seen] = np.where(out[seen] > 0, out[seen] / rep, out[seen] * rep)
    return out - frequency * counts - presence * (counts > 0)


def ref_keep(scaled, top_k, top_p, min_p):
    """Keep set of one temperature-scaled row: top-k, then top-p, then min-p, by value."""
    keep = np.ones(len(scaled), bool)
    if 0 < top_k < len(scaled):
        keep &= scaled >= np.sort(scaled)[::-1][top_k - 1]
    probs = _softmax(np.where(keep, scaled, -np.inf))
    mass, threshold = 0.0, None
    for i in np.argsort(-probs, kind="stable"):
        if mass >= top_p:
            break
        threshold = probs[i]
        mass += probs[i]
    keep &= probs >= threshold
    probs = _softmax(np.where(keep, scaled, -np.inf))
    return keep & (probs >= min_p * probs.max())


# ---------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(stop=3), "stop"),
    (dict(stop=["a", 1]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids="eos"), "stop_token_ids"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias=[5]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3, -2]), "allowed_token_ids"),
])
def test_invalid_params_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        SamplingParams(**kwargs)


def test_params_normalise_stops_and_flags():
    p = SamplingParams(stop="\n", stop_token_ids=[7, np.int64(9)], temperature=0.0, top_k=0)
    assert p.stop == ("\n",) and p.stop_token_ids == (7, 9)
    assert p.greedy and not p.uses_penalties
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().stop == () and SamplingParams().stop_token_ids == ()
    assert SamplingParams(frequency_penalty=0.1).uses_penalties
    hash(p)  # frozen and hashable: usable as a dict key by the engine


# ---------------------------------------------------------------- from_params

def test_from_params_pads_and_encodes_rows():
    params = [SamplingParams(top_k=5, seed=2 ** 40 + 3, min_tokens=3, stop_token_ids=[4],
                             repetition_penalty=1.5),
              SamplingParams(temperature=0.0, ignore_eos=True)]
    t = _tensors(params, prompts=[[1, 2], [3]], outputs=[[9], []], eos_token_ids=[0], pad_to=4)
    np.testing.assert_array_equal(t.top_k, [5, V, V, V])
    np.testing.assert_array_equal(t.temperature, [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(t.seed_keys[0], [2 ** 8, 3])
    np.testing.assert_array_equal(t.has_seed, [True, False, False, False])
    np.testing.assert_array_equal(t.step, [1, 0, 0, 0])
    np.testing.assert_array_equal(t.suppress_stop, [True, False, False, False])
    np.testing.assert_array_equal(t.stop_ids, [[4, 0, -1, -1]] + [[-1] * 4] * 3)
    assert t.history.shape == (4, 16)
    np.testing.assert_array_equal(t.history[0, :4], [1, 2, 9, -1])
    np.testing.assert_array_equal(t.prompt_lens, [2, 1, 0, 0])


def test_from_params_sends_no_history_without_penalties():
    t = _tensors([SamplingParams()], prompts=[list(range(40))], outputs=[[1, 2]])
    assert t.history.shape == (1, 1) and t.history[0, 0] == -1


@pytest.mark.parametrize("kwargs, name", [
    (dict(pad_to=1), "pad_to"),
    (dict(eos_token_ids=[V]), "eos_token_ids"),
    (dict(stop_pad_to=0), "stop_pad_to"),
    (dict(history_pad_to=2), "history_pad_to"),
    (dict(vocab_size=0), "vocab_size"),
])
def test_from_params_rejects_bad_shapes(kwargs, name):
    params = [SamplingParams(repetition_penalty=1.1, stop_token_ids=[1]), SamplingParams()]
    with pytest.raises(ValueError, match=name):
        _tensors(params, prompts=[[1, 2, 3], []], outputs=[[], []], **kwargs)


# ---------------------------------------------------------------- the sampler

def test_greedy_rows_take_argmax_and_logprobs_are_raw():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, V)).astype(np.float32) * 3
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 3 + [SamplingParams()] * 3
    t = _tensors(params, pad_to=8)
    logits = np.concatenate([logits, np.zeros((2, V), np.float32)])
    tokens, chosen, (top_ids, top_vals) = sample(logits, t, jax.random.key(1), num_logprobs=4)
    np.testing.assert_array_equal(tokens[:3], logits[:3].argmax(-1))
    x = logits.astype(np.float64)
    raw = x - x.max(-1, keepdims=True)
    raw -= np.log(np.exp(raw).sum(-1, keepdims=True))
    np.testing.assert_allclose(chosen, raw[np.arange(8), np.asarray(tokens)],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(top_ids[:6], np.argsort(-logits[:6], -1)[:, :4])
    np.testing.assert_allclose(top_vals, np.sort(raw, -1)[:, ::-1][:, :4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixed", [False, True])
def test_all_greedy_steps_take_the_raw_argmax_as_the_full_path_does(mixed):
    """An all-greedy step without penalties or min_tokens skips process_logits (``sample``'s
    plain branch); its tokens equal the full path's (``mixed``: one sampled row forces it) on
    rows with ties at the maximum and filters set, first index among the ties, and its
    logprobs are the raw model's, with or without top logprobs asked."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(8, V)).astype(np.float32)
    logits[:, [5, 9, 40]] = logits.max(-1, keepdims=True) + 1.0      # a three-way tie at the top
    params = [SamplingParams(temperature=0.0, top_k=2, top_p=0.3, min_p=0.5),
              SamplingParams(temperature=0.0)] * 4
    if mixed:
        params[-1] = SamplingParams(temperature=0.7, seed=1)
    t = _tensors(params)
    tokens, chosen, _ = sample(logits, t, jax.random.key(0))
    full = np.asarray(jnp.argmax(process_logits(logits, t), axis=-1))
    n = 7 if mixed else 8
    np.testing.assert_array_equal(np.asarray(tokens)[:n], full[:n])
    np.testing.assert_array_equal(np.asarray(tokens)[:n], 5)
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(chosen, raw[np.arange(8), np.asarray(tokens)], rtol=1e-6, atol=1e-6)
    _, chosen_4, _ = sample(logits, t, jax.random.key(0), num_logprobs=4)
    np.testing.assert_allclose(chosen_4, chosen, rtol=1e-6, atol=1e-6)


def test_no_logprobs_gives_empty_arrays():
    t = _tensors([SamplingParams()])
    _, _, (ids, vals) = sample(np.zeros((1, V), np.float32), t, jax.random.key(0))
    assert ids.shape == (1, 0) and vals.shape == (1, 0)


def test_filters_keep_exactly_the_reference_sets():
    rng = np.random.default_rng(1)
    rows = 32
    logits = (rng.normal(size=(rows, V)) * rng.uniform(0.5, 4, size=(rows, 1))).astype(np.float32)
    params = [SamplingParams(temperature=float(rng.choice([0.3, 0.7, 1.0, 1.8])),
                             top_k=int(rng.choice([-1, 0, 1, 5, 17, V, V + 10])),
                             top_p=float(rng.choice([1.0, 0.95, 0.6, 0.2, 0.01])),
                             min_p=float(rng.choice([0.0, 0.05, 0.3])))
              for _ in range(rows)]
    out = np.asarray(process_logits(logits, _tensors(params)))
    for r, p in enumerate(params):
        scaled = logits[r].astype(np.float64) / p.temperature
        keep = ref_keep(scaled, p.top_k, p.top_p, p.min_p)
        np.testing.assert_array_equal(np.isfinite(out[r]), keep, err_msg=f"row {r}: {p}")
        np.testing.assert_allclose(out[r][keep], scaled[keep], rtol=1e-5, atol=1e-6)


def test_threshold_ties_are_all_kept():
    logits = np.full((2, V), -5.0, np.float32)
    logits[:, :3] = 2.0
    out = process_logits(logits, _tensors([SamplingParams(top_k=2), SamplingParams(top_p=0.1)]))
    np.testing.assert_array_equal(np.isfinite(out).sum(-1), [3, 3])


def test_top_p_one_keeps_the_whole_tail_next_to_filtered_rows():
    logits = np.zeros((2, V), np.float32)
    logits[:, 0] = 30.0          # the tail's f32 mass rounds away: the cumsum hits 1 at rank 0
    out = process_logits(logits, _tensors([SamplingParams(), SamplingParams(top_p=0.5)]))
    np.testing.assert_array_equal(np.isfinite(out).sum(-1), [V, 1])


def test_penalties_match_vllm_formulas():
    rng = np.random.default_rng(2)
    rows = 6
    logits = rng.normal(size=(rows, V)).astype(np.float32) * 2
    prompts = [list(rng.integers(0, V, size=rng.integers(0, 12))) for _ in range(rows)]
    outputs = [list(rng.integers(0, V, size=rng.integers(0, 12))) for _ in range(rows)]
    outputs[0] = [3, 3, 3, 5]
    params = [SamplingParams(repetition_penalty=float(rng.choice([1.0, 0.8, 1.3, 2.0])),
                             presence_penalty=float(rng.choice([0.0, 0.5, -1.0])),
                             frequency_penalty=float(rng.choice([0.0, 0.2, 1.5])),
                             temperature=0.0)
              for _ in range(rows)]
    params[0] = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                               frequency_penalty=0.2, temperature=0.0)
    out = np.asarray(process_logits(logits, _tensors(params, prompts=prompts, outputs=outputs)))
    for r, p in enumerate(params):
        want = ref_penalties(logits[r], prompts[r], outputs[r], p.repetition_penalty,
                             p.presence_penalty, p.frequency_penalty)
        np.testing.assert_allclose(out[r], want, rtol=1e-6, atol=1e-6, err_msg=f"row {r}")


# Upper 0.1% point of chi-square with 7 degrees of freedom (V_SMALL - 1).
CHI2_7DF_P001 = 24.32
V_SMALL = 8


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, -1, 1.0), (1.3, 6, 0.9)])
def test_samples_follow_the_filtered_softmax(seeded, temperature, top_k, top_p):
    n = 20_000
    base = np.array([1.0, 0.5, 0.0, -0.3, 0.8, -1.0, 0.2, -0.6], np.float32)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=7 if seeded else None)] * n
    t = _tensors(params, vocab_size=V_SMALL)
    if seeded:  # one request's stream over steps 0..n-1 (unseeded: n rows of one engine rng)
        t = dataclasses.replace(t, step=np.arange(n, dtype=np.int32))
    tokens, _, _ = sample(np.broadcast_to(base, (n, V_SMALL)), t, jax.random.key(3))
    scaled = base.astype(np.float64) / temperature
    keep = ref_keep(scaled, top_k, top_p, 0.0)
    expected = _softmax(np.where(keep, scaled, -np.inf)) * n
    counts = np.bincount(np.asarray(tokens), minlength=V_SMALL)
    assert np.all(counts[~keep] == 0)
    chi2 = np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep])
    assert chi2 < CHI2_7DF_P001, (counts, expected)


def test_seeded_request_ignores_batch_position_and_neighbours():
    rng = np.random.default_rng(4)
    req = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    logits = rng.normal(size=(V,)).astype(np.float32)
    history = [1, 2, 3]

    def run(position, size, neighbour_seed, rng_seed):
        nrng = np.random.default_rng(neighbour_seed)
        params = [SamplingParams(temperature=float(nrng.uniform(0.1, 2)),
                                 seed=int(nrng.integers(0, 100)) if nrng.random() < 0.5 else None)
                  for _ in range(size)]
        params[position] = req
        outs = [list(nrng.integers(0, V, size=nrng.integers(0, 5))) for _ in range(size)]
        outs[position] = history
        batch = nrng.normal(size=(size, V)).astype(np.float32)
        batch[position] = logits
        t = _tensors(params, outputs=outs, pad_to=8)
        batch = np.concatenate([batch, np.zeros((8 - size, V), np.float32)])
        return int(sample(batch, t, jax.random.key(rng_seed))[0][position])

    got = {run(pos, size, ns, rs) for pos, size, ns, rs in
           [(0, 1, 0, 0), (3, 5, 1, 1), (7, 8, 2, 2), (2, 8, 3, 9)]}
    assert len(got) == 1
    # the stream is fold_in(PRNGKey(seed), step): a reproducible spec, not an implementation detail
    noise = jax.random.gumbel(jax.random.fold_in(jax.random.PRNGKey(1234), len(history)), (V,))
    processed = process_logits(logits[None], _tensors([req], outputs=[history]))[0]
    assert got == {int(jnp.argmax(processed + noise))}


def test_unseeded_rows_differ_and_follow_the_engine_rng():
    t = _tensors([SamplingParams()] * 8)
    logits = np.zeros((8, V), np.float32)
    a = np.asarray(sample(logits, t, jax.random.key(0))[0])
    b = np.asarray(sample(logits, t, jax.random.key(1))[0])
    raw = np.asarray(sample(logits, t, jax.random.key_data(jax.random.key(0)))[0])
    assert len(set(a.tolist())) > 1 and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, raw)


def test_min_tokens_suppresses_stop_and_eos_until_reached():
    eos, stop = 0, 5
    logits = np.zeros((4, V), np.float32)
    logits[:, eos] = 50.0
    logits[:, stop] = 40.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]),
              SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[stop], seed=1),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop]),
              SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)]
    outputs = [[9, 9], [9], [9, 9, 9], [9]]
    t = _tensors(params, outputs=outputs, eos_token_ids=[eos])
    tokens = np.asarray(sample(logits, t, jax.random.key(0))[0])
    assert tokens[0] not in (eos, stop) and tokens[1] not in (eos, stop)
    assert tokens[2] == eos      # min_tokens reached
    assert tokens[3] == eos      # ignore_eos: eos is not a stop token, nothing to suppress


@pytest.mark.parametrize("seed", [0, 7, 2**31 - 1])
def test_step_rng_is_the_fold_in_of_the_seed_key(seed):
    """The engine's per-step rng (one jitted call on a cached key) equals the eager
    ``fold_in(PRNGKey(seed), step)``, for every step and seed."""
    from jaxkv.runner.step import step_rng

    for step in (0, 1, 12345):
        want = jax.random.fold_in(jax.random.PRNGKey(seed), step).astype(jnp.uint32)
        np.testing.assert_array_equal(np.asarray(step_rng(seed, step)), np.asarray(want))


# ---------------------------------------------------------------- logit controls

def test_bitmask_is_xgrammars_layout():
    """Bit ``t & 31`` of int32 word ``t >> 5`` (xgrammar's ``get_bitmask_shape`` layout)."""
    ids = [0, 5, 31, 32, 63, 64, 99]
    words = pack_bitmask(ids, 100)
    assert words.dtype == np.int32 and words.shape == (4,)
    bits = [(int(words[t // 32]) >> (t % 32)) & 1 for t in range(100)]
    assert [t for t, b in enumerate(bits) if b] == ids


def test_logit_bias_and_allowed_ids_match_the_reference():
    """Bias added to the raw logits, then every token outside a row's allowed set at -inf,
    then the temperature (numpy, float64); the chosen token's logprob stays the raw model's;
    rows without controls are untouched, and a step without any carries no arrays for them."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 2
    bias = {3: 5.0, 7: -100.0, 40: 2.5}
    allowed = (1, 7, 40, 63)
    params = [SamplingParams(temperature=0.7, logit_bias=bias),
              SamplingParams(temperature=0.7, allowed_token_ids=allowed),
              SamplingParams(temperature=0.7, logit_bias=bias, allowed_token_ids=allowed),
              SamplingParams(temperature=0.7)]
    t = _tensors(params)
    assert t.bias_ids.shape == (4, 4) and t.token_bitmask.shape == (4, 2)
    want = logits.astype(np.float64)
    for r in (0, 2):
        for i, b in bias.items():
            want[r, i] += b
    for r in (1, 2):
        want[r, [i for i in range(V) if i not in allowed]] = -np.inf
    np.testing.assert_allclose(process_logits(logits, t), want / 0.7, rtol=1e-6, atol=1e-5)
    greedy = [dataclasses.replace(p, temperature=0.0) for p in params]
    tokens, chosen, _ = sample(logits, _tensors(greedy), jax.random.key(0))
    np.testing.assert_array_equal(tokens, np.argmax(want, -1))
    raw = jax.nn.log_softmax(logits.astype(np.float64), -1)
    np.testing.assert_allclose(chosen, raw[np.arange(4), np.asarray(tokens)], atol=1e-5)
    plain = _tensors([SamplingParams()])
    assert plain.bias_ids.shape == plain.token_bitmask.shape == (1, 0)


def test_samples_stay_inside_the_allowed_ids():
    params = [SamplingParams(temperature=1.5, allowed_token_ids=(2, 9, 33), seed=s)
              for s in range(8)]
    t = _tensors(params)
    logits = np.zeros((8, V), np.float32)
    seen = set()
    for step in range(20):
        tokens, _, _ = sample(logits, dataclasses.replace(t, step=t.step + step),
                              jax.random.key(step))
        seen |= set(np.asarray(tokens).tolist())
    assert seen == {2, 9, 33}


def test_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="allowed_token_ids / bad_words_token_ids: id 64"):
        _tensors([SamplingParams(allowed_token_ids=[1, 64])])
