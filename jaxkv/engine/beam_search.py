"""Beam search in the core: beams are scheduler requests that share KV blocks.

Design notes: docs/engine.md."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from jaxkv.sample.sampler import SamplingParams
from jaxkv.sched import scheduler
from jaxkv.sched.state import Request, StopSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """Beam search settings.

    Attributes:
      beam_width: beams kept per prompt (1 .. 10: each beam asks for ``2 * beam_width`` top
        logprobs and the step returns at most 20).
      max_tokens: tokens generated per beam (>= 1).
      length_penalty: exponent of the length normalization of the final ranking.
      ignore_eos: keep extending beams through eos instead of finishing them.
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self):
        if not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width={self.beam_width} must be in [1, 10]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


@dataclasses.dataclass
class BeamSearchSequence:
    """One hypothesis (vLLM's shape).

    Attributes:
      tokens: prompt + generated token ids.
      cum_logprob: sum of the generated tokens' logprobs.
      text: the decoded generated tokens.
      finish_reason: ``"stop"`` (ended with eos) or ``"length"``.
    """

    tokens: list[int]
    cum_logprob: float
    text: str = ""
    finish_reason: str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """The best ``beam_width`` hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def score(tokens: Sequence[int], cum_logprob: float, eos_token_ids: Sequence[int],
          length_penalty: float) -> float:
    """vLLM's beam score: ``cum_logprob / seq_len ** length_penalty`` (a final eos not counted)."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / seq_len ** length_penalty


def run(core, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search with an idle ``EngineCore`` (module docstring); one output per prompt.

    It drives the scheduler itself through the core's driver calls: ``scheduler_state``, then
    ``run`` for each plan it schedules, then ``commit`` of the final state (every beam released).
    """
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
    if core.has_unfinished_requests():
        raise ValueError("beam_search needs an idle engine: finish or abort queued requests first")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    width = params.beam_width
    per_group = core.sched_config.max_num_seqs // width
    if per_group < 1:
        raise ValueError(f"beam_width={width} exceeds max_num_seqs="
                         f"{core.sched_config.max_num_seqs}")
    encoded = []
    for i, p in enumerate(prompts):
        _, ids = core.tokenize(p)
        if len(ids) + params.max_tokens > core.sched_config.max_model_len:
            raise ValueError(f"prompts[{i}]: its {len(ids)} tokens + max_tokens="
                             f"{params.max_tokens} exceed max_model_len="
                             f"{core.sched_config.max_model_len}")
        encoded.append(ids)
    out = []
    for start in range(0, len(encoded), per_group):
        out += _run_group(core, encoded[start:start + per_group], params)
    return out


def _run_group(core, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search of at most ``max_num_seqs // beam_width`` prompts together."""
    width, config = params.beam_width, core.sched_config
    eos = tuple(core.tokenizer.eos_token_ids)
    sampling = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, logprobs=2 * width,
                              ignore_eos=True)
    state = core.scheduler_state
    ids = (f"beam-{n}" for n in itertools.count())
    beams: dict[str, tuple[int, list[int], float]] = {}   # id -> (prompt, tokens, cum logprob)
    for i, prompt in enumerate(prompts):
        rid = next(ids)
        state = scheduler.add_request(state, Request(
            request_id=rid, prompt_token_ids=tuple(prompt),
            stop=StopSpec(max_tokens=params.max_tokens, ignore_eos=True)), config)
        beams[rid] = (i, list(prompt), 0.0)
    finished: list[list[tuple[list[int], float, str]]] = [[] for _ in prompts]
    try:
        for round_ in range(params.max_tokens):
            top = {}   # beam id -> [(token, logprob)], its top 2 * width
            while len(top) < len(beams):
                state, plan = scheduler.schedule(state, config)
                for rid in plan.preempted_ids:
                    top.pop(rid, None)   # its K/V is gone: it is recomputed
                if not plan.seqs:
                    continue
                result = core.run(state, plan, [sampling] * len(plan.seqs))
                for row, seq in enumerate(plan.seqs):
                    if seq.sample:
                        top[seq.request_id] = list(zip(
                            result.top_ids[row, 0, :2 * width].tolist(),
                            result.top_vals[row, 0, :2 * width].tolist()))
                rest = tuple(s for s in plan.seqs if not s.sample)
                state = scheduler.update(state, dataclasses.replace(plan, seqs=rest),
                                         [0] * len(rest))
            forks, last = [], round_ == params.max_tokens - 1
            new_beams = {}
            for i in range(len(prompts)):
                candidates = []
                for rid, (p, tokens, cum) in beams.items():
                    if p != i:
                        continue
                    for token, logprob in top[rid]:
                        if token in eos and not params.ignore_eos:
                            finished[i].append((tokens + [token], cum + logprob, "stop"))
                        else:
                            candidates.append((cum + logprob, rid, token))
                candidates.sort(key=lambda c: -c[0])   # stable: beam order, then top-k order
                for cum, rid, token in candidates[:width]:
                    tokens = beams[rid][1] + [token]
                    if last:
                        finished[i].append((tokens, cum, "length"))
                    else:
                        child = next(ids)
                        forks.append((rid, child, token))
                        new_beams[child] = (i, tokens, cum)
            state = scheduler.fork(state, config, forks, release=tuple(beams))
            beams = new_beams
            if not beams:
                break
    finally:
        for rid in beams:
            if rid in state.requests:
                state = scheduler.abort(state, rid)
        core.commit(state)
    outputs = []
    for i, hyps in enumerate(finished):
        hyps.sort(key=lambda h: -score(h[0], h[1], eos, params.length_penalty))
        n = len(prompts[i])
        outputs.append(BeamSearchOutput([
            BeamSearchSequence(tokens=t, cum_logprob=c, finish_reason=r,
                               text=core.tokenizer.decode(t[n:], skip_special_tokens=True))
            for t, c, r in hyps[:width]]))
    return outputs
