"""A hypothesis state machine of random interleavings through the engine core on the tiny HF
checkpoint, mixing both public layers of the sync facade ``jaxkv.LLM``: ``add_request`` whose
outputs come out of ``step()``, ``stream`` iterators advanced a few ``next`` calls at a time and
closed early, ``abort_request`` (of stepped and streamed requests), ``step()``, request-id reuse,
and a ``generate`` of 1-2 prompts while all of that is open.

The pool is small (12 usable blocks of 8 tokens for up to 8 sequences of up to 80 tokens), so
requests are preempted, and radix prefix caching is on over a few shared prompt prefixes, so
prefixes are hit (both are asserted over the whole run).

After every rule: ``engine.check_invariants()`` (scheduler, block manager and request table
agree). Every output a caller gets belongs to that caller's request, has ``n`` completions of
at most ``max_tokens`` tokens that only ever extend the previous snapshot, carries a legal
finish reason, and a request's final output comes exactly once, to its owner only. A request
id ("a", "b", "c" are drawn again and again) is refused while an earlier request of that id has
not handed its final output to its owner, and accepted once it has. After every
example everything is closed, aborted and stepped out: no block used, nothing running or
waiting, every ``add_request`` reported finished. Greedy and seeded requests must give exactly
the tokens a ``generate`` of the same prompt alone gives (cached per prompt), truncated at their
own ``max_tokens`` and stop tokens: interleaving, preemption, prefix hits and salts never change
outputs.
"""

import collections
import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import HealthCheck, Phase, settings, strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test)

from jaxkv import LLM  # noqa: E402
from jaxkv.sample.sampler import SamplingParams  # noqa: E402
from tiny_models import EOS_IDS, TINY_ENGINE, austen_text  # noqa: E402

# 12 usable blocks of 8 tokens for up to 8 sequences of up to 80 tokens: preemption; float32,
# as the other token-exact engine tests
ENGINE = {**TINY_ENGINE, "max_model_len": 96, "num_kv_blocks": 13, "dtype": "float32",
          "prefix_caching": "radix"}
MAX_TOKENS = 20          # the longest request; references are generated this long
NAMES = ("a", "b", "c")  # explicit request ids (reused on purpose); auto ids are "0", "1", ...
PREFIX_LENS = (8, 13, 21, 30)   # one block, partial blocks, several blocks


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny[0]), **ENGINE) as engine:
        yield engine


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a drawn request asks for (kept beside SamplingParams to key the references)."""

    kind: str            # "greedy" or "seeded" (replays must be deterministic)
    n: int
    max_tokens: int
    seed: int | None
    stop_token_ids: tuple[int, ...]

    def params(self, max_tokens=None, stop=True) -> SamplingParams:
        temperature = {"greedy": 0.0, "seeded": 0.8}[self.kind]
        return SamplingParams(n=self.n, temperature=temperature, seed=self.seed,
                              max_tokens=max_tokens or self.max_tokens,
                              stop_token_ids=list(self.stop_token_ids) if stop else None)


@dataclasses.dataclass
class Record:
    """The test's model of one request."""

    rid: str
    owner: str           # "step", "stream" or "generate"
    prompt: tuple[int, ...]
    spec: Spec
    last: list | None = None     # token ids per sample of the latest snapshot
    final: object = None         # the finished RequestOutput, once delivered
    aborted: bool = False        # abort_request or close() was called while it was live
    closed: bool = False         # a stream closed early (no final output will be delivered)
    seq: int = 0                 # creation order within the example


@st.composite
def prompts(draw):
    """A token prompt: one of the shared prefixes (or none) and a random suffix."""
    prefix = draw(st.sampled_from((None,) + PREFIX_LENS))
    suffix = draw(st.lists(st.integers(3, 399), min_size=0 if prefix else 1, max_size=30))
    head = EngineMachine.prefixes[PREFIX_LENS.index(prefix)] if prefix else []
    return tuple(head + suffix)


@st.composite
def specs(draw):
    kind = draw(st.sampled_from(("greedy", "seeded")))
    stop = draw(st.lists(st.sampled_from(EngineMachine.stop_pool), max_size=2, unique=True))
    return Spec(kind=kind, n=draw(st.sampled_from((1, 1, 2))),
                max_tokens=draw(st.integers(1, MAX_TOKENS)),
                seed=draw(st.integers(0, 3)) if kind == "seeded" else None,
                stop_token_ids=tuple(stop))


salts = st.sampled_from((None, None, "tenant"))
rids = st.one_of(st.none(), st.sampled_from(NAMES))


class EngineMachine(RuleBasedStateMachine):
    llm: LLM = None
    prefixes: list = []
    stop_pool: list = []
    references: dict = {}
    counts: collections.Counter = collections.Counter()
    model_dir = None
    spares: list = []     # engines built after a failure, closed by the test
    dirty = False         # an example failed: its engine may be broken

    def __init__(self):
        super().__init__()
        if EngineMachine.dirty:
            # give the examples hypothesis replays and shrinks after a failure a fresh engine
            # (a broken one fails them all alike); the compiled steps are reused
            EngineMachine.llm = LLM(str(self.model_dir), **ENGINE)
            EngineMachine.spares.append(EngineMachine.llm)
        EngineMachine.dirty = True   # until teardown completes
        # each example starts from the same engine state, so hypothesis can replay it: no cached
        # prefix (hits change how many steps a prefill takes, hence which requests are still
        # live) and one idle step behind it (what the previous example finished is forgotten)
        self.llm.reset_prefix_cache()
        assert self.llm.engine.step() == {}
        self.stepped: dict[str, Record] = {}    # add_request ids whose final is not yet seen
        self.streams: dict[int, tuple] = {}     # open streams: key -> (RequestStream, Record)
        self.ambiguous: set[str] = set()        # ids of closed streams not yet stepped out
        self.records: list[Record] = []         # everything, for the reference check
        self.next_stream = 0

    # ------------------------------------------------------------------ bookkeeping

    def live_records(self):
        """Requests whose final output their owner has not seen (closed streams excluded)."""
        yield from self.stepped.values()
        for _, rec in self.streams.values():
            yield rec

    def check_output(self, out, rec: Record) -> None:
        """One output handed to ``rec``'s owner."""
        assert out.request_id == rec.rid, (out.request_id, rec)
        assert rec.final is None, f"output of {rec.rid!r} after its final output"
        assert out.error is None, out.error
        assert out.prompt_token_ids == list(rec.prompt)
        assert len(out.outputs) == rec.spec.n
        assert [c.index for c in out.outputs] == list(range(rec.spec.n))
        tokens = [list(c.token_ids) for c in out.outputs]
        for i, (comp, ids) in enumerate(zip(out.outputs, tokens)):
            assert len(ids) <= rec.spec.max_tokens, (rec, ids)
            if rec.last is not None:   # cumulative snapshots only grow
                assert ids[:len(rec.last[i])] == rec.last[i], (rec, rec.last[i], ids)
            reason = comp.finish_reason
            assert reason in (None, "stop", "length", "abort"), reason
            if reason == "length":
                assert len(ids) == rec.spec.max_tokens, (rec, ids)
            if reason == "stop":
                assert ids and ids[-1] in set(rec.spec.stop_token_ids) | set(EOS_IDS), (rec, ids)
            if reason == "abort":
                assert rec.aborted, f"{rec.rid!r} aborted though nobody aborted it"
        if out.finished:
            rec.final = out
            self.counts.update(f"finish {c.finish_reason}" for c in out.outputs)
            if rec.aborted:
                assert any(c.finish_reason == "abort" for c in out.outputs), out
        rec.last = tokens

    def id_state(self, name: str) -> str:
        """"busy" (its request's final output is not yet delivered to its owner: a new request
        with this id must be refused), "maybe" (a stream closed since the last engine step: its
        abort may still wait in the engine) or "free" (must be accepted)."""
        if any(rec.rid == name for rec in self.live_records()):
            return "busy"
        return "maybe" if name in self.ambiguous else "free"

    def add(self, owner, prompt, spec, rid, salt, k=0):
        """Adds a request through ``add_request`` or ``stream`` (then advances it ``k``
        outputs); checks request-id reuse."""
        expect = self.id_state(rid) if rid is not None else "free"
        call = self.llm.add_request if owner == "step" else self.llm.stream
        try:
            handle = call({"prompt_token_ids": list(prompt)}, spec.params(), request_id=rid,
                          cache_salt=salt)
        except ValueError:
            assert expect != "free", f"request_id={rid!r} refused though free"
            self.counts["id refused"] += 1
            return
        got = handle if owner == "step" else handle.request_id
        rec = Record(got, owner, prompt, spec, seq=len(self.records))
        self.records.append(rec)
        if owner == "step":
            self.stepped[got] = rec
        else:   # registered before any check, so teardown closes it whatever fails
            self.streams[self.next_stream] = (handle, rec)
            self.next_stream += 1
        assert expect != "busy", f"request_id={rid!r} accepted while its previous request's " \
                                 f"final output is undelivered"
        assert rid is None or got == rid
        if rid is not None:
            self.counts["id reused"] += any(r.rid == rid for r in self.records[:-1])
        self.ambiguous.discard(got)
        if owner == "stream":
            self.advance(self.next_stream - 1, k)

    def deliver_step(self, outs) -> None:
        """Outputs returned by ``llm.step()``."""
        for out in outs:
            rec = self.stepped.get(out.request_id)
            assert rec is not None, f"step() returned {out.request_id!r}, not an add_request id"
            self.check_output(out, rec)
            if rec.final is not None:
                del self.stepped[rec.rid]

    def advance(self, key: int, k: int) -> None:
        stream, rec = self.streams[key]
        for _ in range(k):
            out = next(stream, None)
            assert out is not None, f"stream {rec.rid!r} stopped without its final output"
            self.check_output(out, rec)
            if rec.final is not None:
                with pytest.raises(StopIteration):
                    next(stream)
                del self.streams[key]
                return

    # ------------------------------------------------------------------ rules

    @rule(prompt=prompts(), spec=specs(), rid=rids, salt=salts)
    def add_request(self, prompt, spec, rid, salt):
        self.add("step", prompt, spec, rid, salt)

    @rule(prompt=prompts(), spec=specs(), rid=rids, salt=salts, k=st.integers(0, 3))
    def open_stream(self, prompt, spec, rid, salt, k):
        self.add("stream", prompt, spec, rid, salt, k)

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), k=st.integers(1, 4))
    def advance_stream(self, data, k):
        self.advance(data.draw(st.sampled_from(sorted(self.streams))), k)

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def close_stream(self, data):
        key = data.draw(st.sampled_from(sorted(self.streams)))
        stream, rec = self.streams.pop(key)
        if self.llm.engine.is_live(rec.rid):
            rec.aborted = True
            self.counts["stream closed live"] += 1
        # its abort (now, or by abort_request before) may wait in the engine for a step
        self.ambiguous.add(rec.rid)
        rec.closed = True
        stream.close()
        stream.close()   # idempotent
        with pytest.raises(StopIteration):
            next(stream)
        assert not self.llm.engine.is_live(rec.rid)

    @precondition(lambda self: self.stepped or self.streams)
    @rule(data=st.data())
    def abort_request(self, data):
        recs = sorted(self.live_records(), key=lambda r: r.seq)
        rec = data.draw(st.sampled_from(recs))
        if self.llm.engine.is_live(rec.rid):
            self.llm.abort_request(rec.rid)
            rec.aborted = True
            self.counts["aborted " + rec.owner] += 1
            assert not self.llm.engine.is_live(rec.rid)
        else:   # finished inside the engine; its final output waits for its owner
            with pytest.raises(ValueError):
                self.llm.abort_request(rec.rid)

    @rule(name=st.sampled_from(NAMES + ("never-used",)))
    def abort_unknown(self, name):
        if self.id_state(name) == "free":
            assert not self.llm.engine.is_live(name), f"{name!r} is live though nobody added it"
            with pytest.raises(ValueError):
                self.llm.abort_request(name)

    @rule()
    def step(self):
        pumped = self.llm.has_unfinished_requests()
        self.deliver_step(self.llm.step())
        if pumped:
            self.ambiguous.clear()

    @rule(prompts=st.lists(prompts(), min_size=1, max_size=2),
          specs=st.lists(specs(), min_size=2, max_size=2), salt=salts)
    def generate(self, prompts, specs, salt):
        specs = specs[:len(prompts)]
        busy = {rec.rid for rec in self.live_records()}
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                 [s.params() for s in specs], use_tqdm=False, cache_salt=salt)
        self.ambiguous.clear()
        self.counts["generate with streams open"] += bool(self.streams)
        assert len(outs) == len(prompts)
        for out, prompt, spec in zip(outs, prompts, specs):
            assert out.request_id not in busy and out.request_id not in NAMES
            rec = Record(out.request_id, "generate", prompt, spec, seq=len(self.records))
            self.records.append(rec)
            self.check_output(out, rec)
            assert rec.final is not None, "generate returned an unfinished output"

    @invariant()
    def engine_agrees(self):
        self.llm.engine.check_invariants()
        stats = self.llm.stats()
        assert stats["kv_blocks_used"] + stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["num_running"] <= ENGINE["max_num_seqs"]

    # ------------------------------------------------------------------ teardown

    def teardown(self):
        llm = self.llm
        for key in sorted(self.streams):
            stream, rec = self.streams.pop(key)
            rec.closed = True
            rec.aborted |= llm.engine.is_live(rec.rid)
            stream.close()
        for rec in self.stepped.values():
            if llm.engine.is_live(rec.rid):
                llm.abort_request(rec.rid)
                rec.aborted = True
        for _ in range(500):
            if not llm.has_unfinished_requests():
                break
            self.deliver_step(llm.step())
            llm.engine.check_invariants()
        self.deliver_step(llm.step())   # hands over what the last engine step queued
        assert not llm.has_unfinished_requests()
        assert not self.stepped, f"never reported finished: {sorted(self.stepped)}"
        llm.engine.check_invariants()
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0, stats
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
        self.check_references()
        EngineMachine.dirty = False

    def check_references(self):
        """Greedy and seeded requests against ``generate`` of the same prompt alone."""
        for rec in self.records:
            if rec.last is None:
                continue
            ref = self.reference(rec.prompt, rec.spec)
            reasons = [c.finish_reason for c in rec.final.outputs] if rec.final else \
                [None] * rec.spec.n
            for i, (ids, reason) in enumerate(zip(rec.last, reasons)):
                want = ref[i][:rec.spec.max_tokens]
                for j, t in enumerate(want):
                    if t in rec.spec.stop_token_ids:
                        want = want[:j + 1]
                        break
                if reason in ("stop", "length"):
                    assert ids == want, (rec, i, ids, want)
                else:   # aborted, or a stream closed early: a prefix of it
                    assert ids == want[:len(ids)], (rec, i, ids, want)
                self.counts["reference checks"] += 1

    def reference(self, prompt, spec: Spec):
        key = (prompt, spec.kind, spec.seed, spec.n)
        if key not in self.references:
            out = self.llm.generate({"prompt_token_ids": list(prompt)},
                                    spec.params(max_tokens=MAX_TOKENS, stop=False),
                                    use_tqdm=False)[0]
            self.references[key] = [list(c.token_ids) for c in out.outputs]
        return self.references[key]


def test_random_interleavings_through_the_engine_core(tiny, llm):
    tok = llm.tokenizer
    ids = [t for t in tok.encode(austen_text(2000)) if t < 400]
    EngineMachine.llm, EngineMachine.model_dir = llm, tiny[0]
    EngineMachine.spares, EngineMachine.dirty = [], False
    EngineMachine.prefixes = [ids[:n] for n in PREFIX_LENS[:2]] + \
        [ids[100:100 + n] for n in PREFIX_LENS[2:]]
    # stop ids that greedy decoding of these prompts actually emits, so stops happen
    outs = llm.generate([{"prompt_token_ids": p} for p in EngineMachine.prefixes],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(outs)
    common = collections.Counter(t for o in outs for t in o.outputs[0].token_ids)
    EngineMachine.stop_pool = sorted(t for t, _ in common.most_common(4))
    EngineMachine.references = {}
    EngineMachine.counts = collections.Counter()
    before = llm.stats()
    try:
        run_state_machine_as_test(EngineMachine, settings=settings(
            max_examples=30, stateful_step_count=50, deadline=None, database=None,
            report_multiple_bugs=False,   # and no explain phase: a failure reports sooner
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    finally:
        for spare in EngineMachine.spares:
            spare.close()
    after = llm.stats()
    counts = EngineMachine.counts
    print(dict(counts), {k: after[k] - before[k] for k in
                         ("num_preemptions", "prefix_cache_hits", "num_steps")})
    # the run exercised what it is meant to
    assert after["num_preemptions"] > before["num_preemptions"]
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert counts["reference checks"] > 0
    assert after["kv_blocks_used"] == 0
