"""Sampling: per-request ``SamplingParams`` (host) and one pure jitted sampler over a batch (device).

Design notes: docs/runtime.md."""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Mapping, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cpu_kernels
from jaxkv.config.checks import (BOOLS, ParamTypeError, check_number, check_token_ids,
                                 check_type)
from jaxkv.sample import logit_controls
from jaxkv.sample.structured import StructuredOutputsParams

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them overflows.
GREEDY_TEMPERATURE_EPS = 1e-5
# Padding of the history and stop-id arrays.
PAD_ID = -1
MAX_LOGPROBS = 20   # most top logprobs a request may ask for (OpenAI's cap)

# The numeric fields of SamplingParams and their checks (vLLM's ranges), in field order.
_NUMERIC_FIELDS = {
    "n": dict(kind=int, low=1),
    "temperature": dict(kind=float, low=0),
    "top_p": dict(kind=float, low=0, high=1, low_open=True),
    "top_k": dict(kind=int, low=-1, note=" (-1 or 0: off)"),
    "min_p": dict(kind=float, low=0, high=1),
    "repetition_penalty": dict(kind=float, low=0, low_open=True),
    "presence_penalty": dict(kind=float, low=-2, high=2),
    "frequency_penalty": dict(kind=float, low=-2, high=2),
    "seed": dict(kind=int, low=0, high=2 ** 64, high_open=True, optional=True, note=" (2**64)"),
    "max_tokens": dict(kind=int, low=1),
    "logprobs": dict(kind=int, low=0, optional=True),
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's ``SamplingParams`` fields and defaults).

    Every field is checked on construction: int fields take Python or numpy integers, float
    fields any finite real number (NaN and inf refused), flags bools; a bool is never a number.
    Each is stored as the plain Python type. A wrong type raises ``ParamTypeError`` (a
    ``TypeError``), a wrong value ``ValueError``; both messages start with the field's name.

    Attributes:
      n: completions per prompt (parallel sampling); >= 1.
      temperature: softmax temperature; 0 (or below 1e-5) means greedy argmax.
      top_p: nucleus mass in (0, 1]; 1 keeps every token.
      top_k: keep the k most likely tokens; -1 or 0 keeps every token (0 is stored as -1, as
        both mean off in vLLM).
      min_p: keep tokens with probability >= ``min_p`` x the top probability; in [0, 1].
      repetition_penalty: > 0; > 1 discourages tokens seen in the prompt or output.
      presence_penalty: in [-2, 2]; subtracted once from every token present in the output.
      frequency_penalty: in [-2, 2]; subtracted per occurrence of a token in the output.
      seed: 0 <= seed < 2**64 makes the request's samples reproducible; None draws from the
        engine's stream.
      stop: stop strings; a ``str`` or a list / tuple of them is stored as a tuple.
      stop_token_ids: token ids >= 0 that end the request (besides eos): a list / tuple of ints
        or a 1-D integer array, stored as a tuple (the engine checks them against its vocab).
      max_tokens: most tokens to generate; >= 1.
      min_tokens: stop and eos tokens are suppressed until this many tokens are generated;
        ``0 <= min_tokens <= max_tokens``.
      logprobs: number of top logprobs to return per token (None: none; the chosen token's
        logprob is always computed).
      ignore_eos: keep generating after eos (eos is then neither a stop nor suppressed).
      skip_special_tokens: drop special tokens when detokenizing.
      include_stop_str_in_output: keep the stop string that ended the text in it (default:
        the text ends before it).
      logit_bias: ``{token id: bias}`` added to the raw logits before every other step of
        sampling (OpenAI's ``logit_bias``; each bias in [-100, 100]); stored as a tuple of
        ``(id, bias)`` pairs in id order. Logprobs stay the raw model's (vLLM's default).
      allowed_token_ids: sample only among these ids (a non-empty list / tuple of ints or a
        1-D integer array, stored as a sorted tuple without repeats); None: every token.
      bad_words: words never to generate (vLLM's): the engine tokenizes each, alone and after
        a space, into ``bad_words_token_ids``. Stored as a tuple of str.
      bad_words_token_ids: token id sequences never to generate: the last id of one is banned
        where the generated tokens end with the rest of it (vLLM's rule). Stored as a tuple of
        tuples; the engine adds those of ``bad_words``.
      structured_outputs: a ``jaxkv.sample.structured.StructuredOutputsParams`` (JSON schema,
        regex, choice or grammar) the output must follow; it ends (``finish_reason="stop"``)
        when the grammar does.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    bad_words_token_ids: Sequence[Sequence[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        """Checks every field (type first, then value) and stores it normalised: Python ints and
        floats, ``top_k`` 0 as -1, ``stop`` and ``stop_token_ids`` as tuples, flags as bools.

        Raises:
          ParamTypeError: a field of the wrong type (a ``TypeError``), named first.
          ValueError: a field's value out of range (or NaN / infinite), named first.
        """
        for name, check in _NUMERIC_FIELDS.items():
            object.__setattr__(self, name, check_number(name, getattr(self, name), **check))
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        object.__setattr__(self, "min_tokens", check_number(
            "min_tokens", self.min_tokens, int, low=0, high=self.max_tokens,
            note=f" (max_tokens={self.max_tokens})"))
        stop = () if self.stop is None else self.stop
        if isinstance(stop, str):
            stop = (stop,)
        check_type("stop", stop, (list, tuple), "None, a str or a list of str")
        head = f"stop={reprlib.repr(stop)}: stop"
        object.__setattr__(self, "stop", tuple(
            check_type(f"{head}[{i}]", s, (str,), "a str") for i, s in enumerate(stop)))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        object.__setattr__(self, "stop_token_ids", tuple(check_token_ids("stop_token_ids", ids)))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            object.__setattr__(self, name, bool(check_type(name, getattr(self, name), BOOLS,
                                                           "a bool")))
        self._check_logit_controls()

    def _check_logit_controls(self) -> None:
        """Checks and normalises ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
        ``bad_words_token_ids`` and ``structured_outputs`` (see the class)."""
        if self.logit_bias is not None:
            bias = check_type("logit_bias", self.logit_bias, (Mapping, tuple, list),
                              "None or a dict of token id -> bias")
            pairs = list(bias.items() if isinstance(bias, Mapping) else bias)
            if not all(isinstance(x, tuple) and len(x) == 2 for x in pairs):   # stored pairs
                raise ParamTypeError(f"logit_bias={reprlib.repr(bias)} must be a dict of token "
                                     f"id -> bias")
            head = f"logit_bias={reprlib.repr(bias)}: logit_bias"
            ids = [check_number(f"{head} key {k!r}", k, int, low=0) for k, _ in pairs]
            values = [check_number(f"{head}[{i}]", b, float, low=-100, high=100)
                      for i, (_, b) in zip(ids, pairs)]
            object.__setattr__(self, "logit_bias", tuple(sorted(dict(zip(ids, values)).items())))
        if self.allowed_token_ids is not None:
            ids = check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not ids:
                raise ValueError("allowed_token_ids=[] allows no token (None allows every one)")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(ids))))
        words = () if self.bad_words is None else self.bad_words
        check_type("bad_words", words, (list, tuple), "None or a list of str")
        head = f"bad_words={reprlib.repr(words)}: bad_words"
        object.__setattr__(self, "bad_words", tuple(
            check_type(f"{head}[{i}]", w, (str,), "a str") for i, w in enumerate(words)))
        if any(not w.strip() for w in self.bad_words):
            raise ValueError(f"{head}: a word is empty or only spaces")
        seqs = () if self.bad_words_token_ids is None else self.bad_words_token_ids
        check_type("bad_words_token_ids", seqs, (list, tuple), "None or a list of id lists")
        seqs = tuple(tuple(check_token_ids(f"bad_words_token_ids[{i}]", q))
                     for i, q in enumerate(seqs))
        if any(not q for q in seqs):
            raise ValueError("bad_words_token_ids: a sequence is empty")
        object.__setattr__(self, "bad_words_token_ids", tuple(dict.fromkeys(seqs)))
        check_type("structured_outputs", self.structured_outputs,
                   (StructuredOutputsParams, type(None)), "None or a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def uses_penalties(self) -> bool:
        """True when any penalty is active, so the sampler needs the token history."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _bucket(n: int, minimum: int) -> int:
    """The smallest power of two ``>= max(n, minimum)`` (``minimum`` a power of two)."""
    size = minimum
    while size < n:
        size *= 2
    return size


def _key_data(seed: int) -> tuple[int, int]:
    """threefry2x32 key words of a 64-bit seed (equal to ``PRNGKey(seed)`` for seed < 2**31)."""
    return seed >> 32, seed & 0xFFFFFFFF


_FIELDS = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "seed_keys", "has_seed", "step", "history", "prompt_lens",
           "suppress_stop", "stop_ids", "bias_ids", "bias_values", "token_bitmask"]


@partial(jax.tree_util.register_dataclass, data_fields=_FIELDS, meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, padded to the sequence bucket ``S``.

    Padding rows are greedy with every filter and penalty off; their outputs are ignored.

    Attributes:
      temperature: f32 [S]; 0 for greedy rows.
      top_k: int32 [S]; ``V`` when off.
      top_p: f32 [S]; 1 when off.
      min_p: f32 [S]; 0 when off.
      repetition_penalty: f32 [S]; 1 when off.
      presence_penalty: f32 [S]; 0 when off.
      frequency_penalty: f32 [S]; 0 when off.
      seed_keys: uint32 [S, 2] threefry key words of each row's seed (0 when unseeded).
      has_seed: bool [S]; False rows draw from the engine rng instead.
      step: int32 [S] tokens generated so far; advances a seeded row's stream.
      history: int32 [S, L] prompt ids, then output ids, then -1 padding (L = 1 and all -1 when
        no row uses a penalty).
      prompt_lens: int32 [S] prompt length of each row inside ``history``.
      suppress_stop: bool [S]; True while ``step < min_tokens`` (stop and eos ids masked).
      stop_ids: int32 [S, K] stop token ids plus eos (unless ``ignore_eos``), -1 padded.
      bias_ids, bias_values: int32 / f32 [S, B] each row's ``logit_bias``, -1 / 0 padded
        (B = 0 when no row has one: the step then skips it).
      token_bitmask: int32 [S, ceil(V / 32)] the tokens a row may sample: bit ``t & 31`` of
        word ``t >> 5`` (xgrammar's layout; -1: every token), or [S, 0] when no row restricts.
    """

    temperature: jax.Array         # [S] f32
    top_k: jax.Array               # [S] i32
    top_p: jax.Array               # [S] f32
    min_p: jax.Array               # [S] f32
    repetition_penalty: jax.Array  # [S] f32
    presence_penalty: jax.Array    # [S] f32
    frequency_penalty: jax.Array   # [S] f32
    seed_keys: jax.Array           # [S, 2] u32
    has_seed: jax.Array            # [S] bool
    step: jax.Array                # [S] i32
    history: jax.Array             # [S, L] i32
    prompt_lens: jax.Array         # [S] i32
    suppress_stop: jax.Array       # [S] bool
    stop_ids: jax.Array            # [S, K] i32
    bias_ids: jax.Array            # [S, B] i32
    bias_values: jax.Array         # [S, B] f32
    token_bitmask: jax.Array       # [S, ceil(V / 32) or 0] i32

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], *, vocab_size: int,
                    prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]],
                    eos_token_ids: Sequence[int] = (), pad_to: int | None = None,
                    history_pad_to: int | None = None, stop_pad_to: int | None = None,
                    grammar_bitmasks: Sequence[np.ndarray | None] | None = None
                    ) -> SamplingTensors:
        """Builds the numpy arrays of one step on the host.

        Args:
          params: one ``SamplingParams`` per real row, in row order.
          vocab_size: ``V``, the logits width; every stop/eos id must be below it.
          prompt_token_ids: each row's prompt ids (read only when a row uses a penalty).
          output_token_ids: each row's generated ids so far; their count is the row's ``step``.
          eos_token_ids: the model's eos ids, suppressed under ``min_tokens`` unless ``ignore_eos``.
          pad_to: the sequence bucket ``S >= len(params)`` (default ``len(params)``).
          history_pad_to: width ``L`` of ``history`` when a row uses a penalty (default: the
            smallest power of two >= 16 that holds the longest prompt + output).
          stop_pad_to: width ``K`` of ``stop_ids`` (default: the smallest power of two >= 4 that
            holds the most stop ids of a row).
          grammar_bitmasks: per row, the int32 [ceil(V / 32)] tokens its structured output
            allows at this position, or None (``jaxkv.sample.structured.Matcher.bitmasks``).

        Returns:
          SamplingTensors of numpy arrays; ``jax.device_put`` or pass them to a jitted step.

        Raises:
          ValueError: naming the argument whose length or value does not fit.
        """
        rows = len(params)
        if len(prompt_token_ids) != rows or len(output_token_ids) != rows:
            raise ValueError(
                f"prompt_token_ids ({len(prompt_token_ids)}) and output_token_ids "
                f"({len(output_token_ids)}) must have one entry per params ({rows})")
        if vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size} must be >= 1")
        size = rows if pad_to is None else pad_to
        if size < max(rows, 1):
            raise ValueError(f"pad_to={pad_to} must be >= len(params)={rows} and >= 1")

        stops = [tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_token_ids))
                 for p in params]
        if any(not 0 <= i < vocab_size for s in stops for i in s):
            raise ValueError(
                f"stop_token_ids / eos_token_ids must lie in [0, vocab_size={vocab_size})")
        width_k = _bucket(max((len(s) for s in stops), default=0), 4)
        if stop_pad_to is not None:
            if stop_pad_to < max((len(s) for s in stops), default=0) or stop_pad_to < 1:
                raise ValueError(f"stop_pad_to={stop_pad_to} is smaller than a row's stop ids")
            width_k = stop_pad_to

        penalised = any(p.uses_penalties for p in params)
        width_l = 1
        if penalised:
            longest = max(len(a) + len(b) for a, b in zip(prompt_token_ids, output_token_ids))
            width_l = _bucket(longest, 16)
            if history_pad_to is not None:
                if history_pad_to < longest:
                    raise ValueError(
                        f"history_pad_to={history_pad_to} < longest prompt + output={longest}")
                width_l = history_pad_to

        # padding rows: greedy (temperature 0), every filter and penalty at its neutral value
        neutral = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0}
        t = {name: np.full(size, value, np.float32) for name, value in neutral.items()}
        top_k = np.full(size, vocab_size, np.int32)
        seed_keys = np.zeros((size, 2), np.uint32)
        has_seed = np.zeros(size, bool)
        step = np.zeros(size, np.int32)
        history = np.full((size, width_l), PAD_ID, np.int32)
        prompt_lens = np.zeros(size, np.int32)
        suppress = np.zeros(size, bool)
        stop_ids = np.full((size, width_k), PAD_ID, np.int32)
        for r, p in enumerate(params):
            for name in neutral:
                t[name][r] = getattr(p, name)
            if p.greedy:
                t["temperature"][r] = 0.0
            top_k[r] = vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size)
            if p.seed is not None:
                seed_keys[r] = _key_data(p.seed)
                has_seed[r] = True
            step[r] = len(output_token_ids[r])
            if penalised:
                prompt, out = prompt_token_ids[r], output_token_ids[r]
                history[r, :len(prompt)] = prompt
                history[r, len(prompt):len(prompt) + len(out)] = out
                prompt_lens[r] = len(prompt)
            suppress[r] = step[r] < p.min_tokens
            stop_ids[r, :len(stops[r])] = stops[r]
        return cls(top_k=top_k, seed_keys=seed_keys, has_seed=has_seed, step=step,
                   history=history, prompt_lens=prompt_lens, suppress_stop=suppress,
                   stop_ids=stop_ids,
                   **logit_controls.host_arrays(params, output_token_ids, vocab_size, size,
                                                 grammar_bitmasks),
                   **t)


def _row_mask(ids: jax.Array, vocab_size: int, values: jax.Array) -> jax.Array:
    """Scatter-adds ``values`` [S, L] at ``ids`` [S, L] (-1 = skip) into int32 [S, V]."""
    rows = jnp.arange(ids.shape[0])[:, None]
    cols = jnp.where(ids >= 0, ids, vocab_size)          # padding lands in a spare column V
    out = jnp.zeros((ids.shape[0], vocab_size + 1), jnp.int32)
    return out.at[rows, cols].add(values.astype(jnp.int32))[:, :vocab_size]


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """vLLM's repetition / frequency / presence penalties.

    Args:
      logits: f32 [S, V].
      t: the step's tensors (``history``, ``prompt_lens`` and the three penalties).

    Returns:
      f32 [S, V]: ``l / r`` (l > 0) or ``l * r`` (l <= 0) for tokens seen in prompt or output,
      then ``- frequency * output_count - presence * [output_count > 0]``.
    """
    vocab_size = logits.shape[1]
    valid = t.history >= 0
    is_output = valid & (jnp.arange(t.history.shape[1])[None, :] >= t.prompt_lens[:, None])
    seen = _row_mask(t.history, vocab_size, valid) > 0                     # [S, V]
    out_counts = _row_mask(t.history, vocab_size, is_output)               # [S, V]
    rep = jnp.where(seen, t.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - t.frequency_penalty[:, None] * out_counts
    return logits - t.presence_penalty[:, None] * (out_counts > 0)


def _filter_top_k_top_p(scaled: jax.Array, t: SamplingTensors) -> jax.Array:
    """Top-k then top-p by value thresholds on temperature-scaled logits f32 [S, V]."""
    vocab_size = scaled.shape[1]
    desc = -jnp.sort(-scaled, axis=-1)                                      # [S, V] high first
    kth = jnp.take_along_axis(desc, (t.top_k - 1)[:, None], axis=-1)        # [S, 1]
    scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    # Top-p over the top-k survivors: in the sorted row, rank j survives the nucleus iff the mass
    # of ranks < j is below top_p; the last survivor's logit is the keep threshold.
    desc = jnp.where(desc >= kth, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.pad(mass_before[:, :-1], ((0, 0), (1, 0)))            # exclusive cumsum
    last = jnp.sum(mass_before < t.top_p[:, None], axis=-1) - 1             # [S] >= 0
    last = jnp.clip(last, 0, vocab_size - 1)
    threshold = jnp.take_along_axis(desc, last[:, None], axis=-1)
    # top_p == 1 keeps all: the f32 cumsum may reach 1 before the tail (and rows must not depend
    # on whether a neighbour made this branch run)
    threshold = jnp.where(t.top_p[:, None] >= 1.0, -jnp.inf, threshold)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def first_argmax(x: jax.Array, top: jax.Array | None = None) -> jax.Array:
    """``argmax`` over the last axis (first index of the maximum), int32 [S] for x [S, V].

    Two plain reductions (max, then min index where equal), which XLA vectorizes on CPU: about
    2x faster there than ``jnp.argmax``'s variadic reduce over a 49K vocabulary. ``top``: the
    rows' maxima [S, 1] if already computed.
    """
    top = x.max(axis=-1, keepdims=True) if top is None else top
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.minimum(jnp.min(jnp.where(x == top, ids, x.shape[-1]), axis=-1), x.shape[-1] - 1)


def row_stats(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's first argmax, maximum and log-sum-exp: (int32 [S], f32 [S], f32 [S]) for
    f32 x [S, V], where ``x[j] - top - log_norm`` is token j's log-probability.

    On the CPU one pass of ``jaxkv.cpu_kernels.row_stats`` per row while it is in cache (XLA
    runs the three as separate passes over [S, V]); elsewhere ``first_argmax`` and two jnp
    reductions, which agree with it on ties (the first index).
    """
    if cpu_kernels.native():
        return cpu_kernels.row_stats(x)
    top = x.max(axis=-1, keepdims=True)                                    # [S, 1]
    return first_argmax(x, top), top[:, 0], jnp.log(jnp.sum(jnp.exp(x - top), axis=-1))


def _penalised(t: SamplingTensors) -> jax.Array:
    """True (a bool scalar) when a row of the step uses a penalty."""
    return jnp.any((t.repetition_penalty != 1.0) | (t.frequency_penalty != 0.0)
                   | (t.presence_penalty != 0.0))


@jax.jit
def process_logits(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Logit bias and allowed tokens, penalties, min_tokens suppression, temperature, top-k,
    top-p and min-p.

    Args:
      logits: [S, V] raw model logits (any float dtype; computed in f32).
      t: the step's SamplingTensors.

    Returns:
      f32 [S, V] temperature-scaled logits with filtered tokens at ``-inf``; greedy rows are
      scaled by 1 (their argmax is the greedy token). ``softmax`` of a row is the distribution
      the row samples from.
    """
    logits = logit_controls.apply(logits.astype(jnp.float32), t.bias_ids, t.bias_values,
                                  t.token_bitmask)
    logits = jax.lax.cond(_penalised(t), apply_penalties, lambda x, _: x, logits, t)
    stop = _row_mask(t.stop_ids, logits.shape[1], t.stop_ids >= 0) > 0
    logits = jnp.where(t.suppress_stop[:, None] & stop, -jnp.inf, logits)
    temperature = jnp.where(t.temperature < GREEDY_TEMPERATURE_EPS, 1.0, t.temperature)
    scaled = logits / temperature[:, None]
    needs_sort = jnp.any((t.top_k < logits.shape[1]) | (t.top_p < 1.0))
    scaled = jax.lax.cond(needs_sort, _filter_top_k_top_p, lambda s, _: s, scaled, t)
    # min-p: p >= min_p * p_max  <=>  l >= l_max + log(min_p) (the softmax normaliser cancels).
    top = jnp.max(scaled, axis=-1, keepdims=True)
    return jnp.where(scaled >= top + jnp.log(t.min_p)[:, None], scaled, -jnp.inf)


def _row_keys(t: SamplingTensors, rng: jax.Array) -> jax.Array:
    """One typed threefry key per row: seeded rows fold their step, others fold their row index."""
    if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng, impl="threefry2x32")
    seeded = jax.vmap(jax.random.fold_in)(
        jax.random.wrap_key_data(t.seed_keys, impl="threefry2x32"), t.step)
    rows = jnp.arange(t.step.shape[0], dtype=jnp.uint32)
    unseeded = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, rows)
    data = jnp.where(t.has_seed[:, None], jax.random.key_data(seeded),
                     jax.random.key_data(unseeded))
    return jax.random.wrap_key_data(data, impl="threefry2x32")


@partial(jax.jit, static_argnames="num_logprobs")
def sample(logits: jax.Array, t: SamplingTensors, rng: jax.Array, *,
           num_logprobs: int = 0) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """Draws one token per row.

    Args:
      logits: [S, V] raw model logits of each row's last position (computed in f32).
      t: SamplingTensors with the same ``S``.
      rng: the engine's key for this step (typed or raw threefry ``uint32 [2]``), used by rows
        without a seed; advance it every step.
      num_logprobs: static ``N``, top logprobs returned per row (0: empty arrays).

    Returns:
      tokens: int32 [S] sampled (or greedy) token of each row.
      logprobs: f32 [S] raw-model logprob of each row's token.
      top_logprobs: (ids int32 [S, N], values f32 [S, N]) the raw model's N most likely tokens,
        highest first.
    """
    x = logits.astype(jnp.float32)
    first, top, log_norm = row_stats(x)                                    # [S] each
    greedy = t.temperature < GREEDY_TEMPERATURE_EPS

    def drawn(x):                # [S] tokens of the processed logits (penalties, filters, noise)
        processed = process_logits(x, t)

        def with_noise(processed):   # Gumbel-max for the random rows (skipped when all greedy)
            keys = _row_keys(t, rng)
            noise = jax.vmap(lambda k: jax.random.gumbel(k, processed.shape[1:], jnp.float32))(
                keys)
            return jnp.where(greedy[:, None], processed, processed + noise)

        return first_argmax(jax.lax.cond(jnp.all(greedy), lambda p: p, with_noise, processed))

    # Every row greedy with no penalty, no stop suppression and no logit control: the filters
    # keep each row's maximum (by value, ties included), so the token is the raw argmax, and
    # none of the [S, V] passes of process_logits is needed.
    plain = (jnp.all(greedy) & ~_penalised(t) & ~jnp.any(t.suppress_stop)
             & (not logit_controls.present(t.bias_ids, t.token_bitmask)))
    tokens = jax.lax.cond(plain, lambda x: first, drawn, x).astype(jnp.int32)
    if not num_logprobs:         # the chosen token's raw logprob, without the [S, V] array
        chosen = (jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - top) - log_norm
        return tokens, chosen, (jnp.zeros((x.shape[0], 0), jnp.int32),
                                jnp.zeros((x.shape[0], 0), jnp.float32))
    # with top logprobs, the chosen one is read from the same array, so it is one of them exactly
    raw = jax.nn.log_softmax(x, axis=-1)                                   # [S, V]
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(raw, num_logprobs)
    return tokens, chosen, (top_ids.astype(jnp.int32), top_values)
