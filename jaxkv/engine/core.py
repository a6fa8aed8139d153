"""EngineCore: the only step loop of jaxkv. Requests in, outputs keyed by request id out.

Design notes: docs/engine.md."""

from __future__ import annotations

import dataclasses
import logging
import time
import types
from collections.abc import Sequence

from jaxkv.blocks.host_tier import SwapCostModel
from jaxkv.config import EngineConfig
from jaxkv.engine.outputs import RequestOutput
from jaxkv.engine.requests import EngineRequest, RequestTable
from jaxkv.runner import huge_pages
from jaxkv.runner.compile_cache import enable_compilation_cache
from jaxkv.runner.kv_offload import KVOffload
from jaxkv.runner.model_runner import ModelRunner, RowInput, StepOutput
from jaxkv.sample import structured
from jaxkv.sample.sampler import SamplingParams
from jaxkv.sched import scheduler
from jaxkv.sched.plan import StepPlan
from jaxkv.sched.state import Request, SchedulerState, init_state, with_cost_model
from jaxkv.spec_decode.speculator import Speculator

logger = logging.getLogger("jaxkv")


class EngineCore:
    """The engine: add and abort requests, step, read outputs keyed by request id.

    Args:
      config: the engine config (``EngineConfig.from_kwargs(**LLM kwargs)``).

    Attributes:
      config: as given.
      runner: the ``ModelRunner`` (params, cache, jitted step; ``runner.params`` etc.).
      tokenizer, model_config, sched_config, cache_config, memory_plan: shortcuts to the
        runner's.
      compilation_cache_dir: where JAX's persistent compilation cache lives (None: off).
      speculator: proposes draft tokens before each schedule (``speculative=...``; without it
        its proposer is None and steps carry no drafts).
      kv_events: the KV-cache event publisher (``kv_events_config``), or None.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        rc = config.runtime
        self.compilation_cache_dir = (enable_compilation_cache(rc.compilation_cache_dir)
                                      if rc.compilation_cache else None)
        self.runner = r = ModelRunner(config)
        huge_pages.collapse_in_background(r.params)   # CPU arrays only; advice only
        if config.offload.kv_offload_bytes:
            r.attach_offload(*KVOffload.build(
                r.cache, r.kv_spec, config.offload, model_path=r.model_path,
                model_config=r.model_config, tensor_parallel_size=r.tensor_parallel_size,
                kv_groups=r.cache_config.kv_groups),
                preemption_mode=config.offload.preemption_mode)
        self.tokenizer, self.model_config = r.tokenizer, r.model_config
        self.sched_config, self.cache_config = r.sched_config, r.cache_config
        self.memory_plan = r.memory_plan
        offload = r.offload
        self._state = init_state(self.cache_config, None if offload is None else offload.disk,
                                 kv_events=config.kv_events.enabled)
        if offload is not None:
            self._state = with_cost_model(self._state, SwapCostModel(
                offload.pool.block_bytes, *offload.copy_bandwidth))
        self.kv_events = self._kv_tracker = None
        try:   # a draft model is checked against the target (vocabulary) and loaded here
            self.speculator = Speculator.from_args(config.speculative, config, self.runner)
            if config.kv_events.enabled:
                self._open_kv_events(config.kv_events.kv_events_config)
        except BaseException:
            self.runner.close()
            raise
        self._table = RequestTable(self.tokenizer, self.model_config.vocab_size,
                                   self.sched_config.max_model_len)
        self._pending: dict[str, RequestOutput] = {}   # finished outside a step (aborts)
        self._num_preemptions = 0
        self._peak_usage = 0.0
        self._num_generated = 0
        self._num_prompt_tokens = 0
        self._num_computed_tokens = 0   # tokens the device computed (no padding)
        self._num_lookup_tokens = 0     # prefix-cache queries, tokens
        self._num_hit_tokens = 0        # of which found cached (or shared by a fork)
        self._num_host_hit_tokens = 0   # of which promoted from the host tier (disk included)
        self._num_disk_hit_tokens = 0   # of which read from the persistent cache
        self._num_swapped = 0           # preemptions by swap
        self._prefill_rate = None       # tokens/s of the steps that prefill (cost model)
        self._num_errors = 0
        self._busy_time = 0.0           # seconds inside step()
        self._closed = False
        if config.runtime.warmup:
            self.warmup()

    def _open_kv_events(self, cfg) -> None:
        """Binds the KV-cache event sockets (jaxkv/engine/kv_event_publisher.py)."""
        try:
            from jaxkv.engine.kv_event_publisher import ZmqEventPublisher
            from jaxkv.engine.kv_event_tracker import KVEventTracker
            from jaxkv.engine.kv_event_wire import Wire
        except ImportError as e:
            raise ImportError(f"kv_events_config needs pyzmq and msgspec (pip install "
                              f"'jaxkv[kv-events]'): {e}") from None
        wire = Wire(cfg.encoding)
        self._kv_tracker = KVEventTracker(wire, self.cache_config.block_size)
        self.kv_events = ZmqEventPublisher(cfg, wire)

    def _publish_kv_events(self) -> None:
        """Publishes the block owners' cache transitions since the last call as one batch
        (none when there were none), as vLLM does once per step."""
        if self.kv_events is None:
            return
        state = self._state
        records = state.block_manager.take_kv_events()
        if state.host is not None:
            records += state.host.take_kv_events()
        events = self._kv_tracker.events(records)
        if events:
            self.kv_events.publish(time.time(), events)

    def warmup(self, shapes: Sequence[tuple[int, int]] | None = None) -> int:
        """Compiles every step bucket, or the padded ``shapes`` only (``ModelRunner.warmup``);
        after all of them the speculator's step-time model keeps each shape's first duration.
        Returns how many step variants."""
        num_variants = self.runner.warmup(shapes)
        if shapes is None and self.speculator.step_cost is not None:
            self.speculator.step_cost.compiled()
        return num_variants

    # ------------------------------------------------------------------ requests

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was closed")

    def add_requests(self, requests: Sequence[dict]) -> list[str]:
        """Queues several requests all together, or none of them.

        Args:
          requests: dicts of ``add_request``'s arguments (``prompt``, and optionally
            ``sampling_params``, ``request_id``, ``priority``, ``cache_salt``).

        Returns:
          Their request ids, in order.

        Raises:
          TypeError, ValueError: naming the request (``requests[i]``) and its bad field;
            nothing is queued then and the requests already in the engine keep running.
        """
        self._check_open()
        new: list[tuple[EngineRequest, list[Request]]] = []
        ids = set()
        for i, r in enumerate(requests):
            try:
                req = self._table.new_request(
                    r["prompt"], r.get("sampling_params") or SamplingParams(),
                    priority=r.get("priority", 0), request_id=r.get("request_id"),
                    cache_salt=r.get("cache_salt"))
                if req[0].request_id in ids or req[0].request_id in self._pending:
                    raise ValueError(f"request_id={req[0].request_id!r} is already in use")
                ids.add(req[0].request_id)
            except (TypeError, ValueError) as e:
                raise type(e)(f"requests[{i}]: {e}" if len(requests) > 1 else str(e)) from None
            new.append(req)
        state = self._state
        for _, reqs in new:
            for r in reqs:
                state = scheduler.add_request(state, r, self.sched_config)
        self._state = state
        self._table.add(new)
        return [req.request_id for req, _ in new]

    def compile_structured_outputs(self, spec: structured.StructuredOutputsParams) -> None:
        """Compiles ``spec`` into the grammar cache (thread-safe; ``AsyncLLM`` does it in the
        caller's thread, so ``add_request`` under the engine lock only finds it).

        Raises:
          ValueError: it cannot be compiled, naming ``structured_outputs.<kind>``.
        """
        self._table.grammars().compile(spec)

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> str:
        """Queues one request; returns its id.

        Args:
          prompt: a non-empty str, or ``{"prompt_token_ids": [int, ...]}`` (optionally with
            ``"prompt"``: its text).
          sampling_params: default ``SamplingParams()``.
          request_id: a str unique among live requests (default: a fresh number).
          priority: the ``"priority"`` policy's key (lower is more urgent).
          cache_salt: prefix-cache namespace (a str): the request shares cached blocks only
            with requests of the same salt (tenant isolation).

        Raises:
          TypeError, ValueError: naming the bad field; nothing is queued then.
        """
        return self.add_requests([dict(prompt=prompt, sampling_params=sampling_params,
                                       request_id=request_id, priority=priority,
                                       cache_salt=cache_salt)])[0]

    def abort_request(self, request_id: str) -> None:
        """Aborts a queued or running request; its blocks are freed at once and its final
        output (``finish_reason="abort"``) comes out of the next ``step``.

        Raises:
          ValueError: ``request_id`` is not queued or running.
        """
        req = self._table.requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id={request_id!r} is not queued or running")
        state = self._state
        for seq_id in self._table.seq_ids(request_id):
            state = scheduler.abort(state, seq_id)
        self._state = state
        self.speculator.forget(state)
        self._pending |= self._collect()

    def is_live(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or running."""
        return request_id in self._table.requests

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt, validated as ``add_request`` does.

        Raises:
          TypeError, ValueError: naming what is wrong with the prompt.
        """
        return self._table.tokenize(prompt)

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued or running, or a final output is still to be stepped out."""
        return bool(self._state.requests) or bool(self._pending)

    def num_unfinished_requests(self) -> int:
        """Requests queued or running."""
        return len(self._table.requests)

    # ------------------------------------------------------------------ the step

    def step(self) -> dict[str, RequestOutput]:
        """Runs one engine step.

        Returns:
          ``{request_id: RequestOutput}`` of every request that got tokens this step or finished
          (a finished one exactly once, with ``finished`` True, then forgotten); each output is
          a snapshot that later steps do not change.
        """
        self._check_open()
        t0 = time.perf_counter()
        outputs = self._pending   # handed out only if this step succeeds
        state, plan = scheduler.schedule(self._state, self.sched_config,
                                         self.speculator.drafts(self._state))
        if not plan.seqs:
            self.runner.transfer(plan)   # e.g. the only running request swapped itself out
            self._state, self._pending = state, {}
            self._num_preemptions += len(plan.preempted_ids)
            self._num_swapped += len(plan.swapped_ids)
            self._publish_kv_events()
            return outputs | self._collect()
        samples = self._table.samples
        rows = _rows(state, plan, [samples[s.request_id].params for s in plan.seqs],
                     [samples[s.request_id].matcher for s in plan.seqs])
        device_before = self.runner.device_time
        try:
            result = self.runner.execute(plan, rows)
        except (TypeError, ValueError) as exc:   # before the device: the state stays as it was
            culprits = self._failing_rows(plan, rows)
            if not culprits:
                raise
            self._pending = {}
            for request_id, err in culprits.items():
                outputs |= self._fail(request_id, err)
            logger.warning("step without %d failing request(s): %s", len(culprits), exc)
            return outputs
        self._pending = {}
        self._num_preemptions += len(plan.preempted_ids)
        self._num_swapped += len(plan.swapped_ids)
        self._count(plan, state)
        seconds = self.runner.device_time - device_before
        state = self._refit_cost(state, plan, seconds)
        self.speculator.record(plan, result.tokens, result.num_accepted, seconds)
        now = time.perf_counter()
        touched, accepted, stop_hits, errors = self._apply(plan, state, result, t0, now)
        self._state = scheduler.update(state, plan, accepted, finished_ids=frozenset(stop_hits),
                                       block_mass=result.block_mass)
        for request_id, err in errors.items():
            outputs |= self._fail(request_id, err)
        self.speculator.forget(self._state)
        self._publish_kv_events()
        outputs |= self._collect()
        for request_id, req in touched.items():
            if request_id not in outputs:
                outputs[request_id] = req.output()
        self._busy_time += time.perf_counter() - t0
        return outputs

    def _refit_cost(self, state: SchedulerState, plan: StepPlan,
                    seconds: float) -> SchedulerState:
        """``state`` with the swap-or-recompute model's prefill rate refitted to the step just
        run (``seconds`` of device time; a moving average over steps of at least 64 tokens),
        when a host tier is on."""
        if state.cost is None or plan.num_tokens < 64:
            return state
        rate = plan.num_tokens / max(seconds, 1e-9)
        self._prefill_rate = rate if self._prefill_rate is None else (
            0.7 * self._prefill_rate + 0.3 * rate)
        return with_cost_model(state, dataclasses.replace(
            state.cost, prefill_tokens_per_s=self._prefill_rate))

    def _failing_rows(self, plan: StepPlan, rows: Sequence[RowInput]) -> dict[str, str]:
        """Of a step that failed before the device: the requests whose own rows fail alone,
        by request id -> the error text."""
        out = {}
        for seq, row in zip(plan.seqs, rows):
            try:
                self.runner.sampling_tensors([row], 1)
            except (TypeError, ValueError) as e:
                out.setdefault(self._table.samples[seq.request_id].parent,
                               f"{type(e).__name__}: {e}")
        return out

    def _count(self, plan: StepPlan, state: SchedulerState) -> None:
        self._num_lookup_tokens += plan.num_lookup_tokens
        self._num_hit_tokens += plan.num_hit_tokens
        self._num_host_hit_tokens += plan.num_host_hit_tokens
        self._num_disk_hit_tokens += plan.num_disk_hit_tokens
        self._num_computed_tokens += plan.num_tokens
        self._peak_usage = max(self._peak_usage, state.block_manager.usage())

    def _apply(self, plan: StepPlan, state: SchedulerState,
               result: StepOutput, t0: float, now: float):
        """Hands each sequence's emitted tokens, in order, to its request's bookkeeping (text,
        logprobs, stop strings), up to the first that stops it (``scheduler.accepted_tokens``,
        or a stop string).

        Returns:
          (requests that got a token by id, the tokens ``scheduler.update`` appends per row,
          sequence ids whose stop string matched, request ids whose bookkeeping raised -> the
          error text).
        """
        samples = self._table.samples
        touched: dict[str, EngineRequest] = {}
        accepted = [result.tokens[row, :n] for row, n in enumerate(result.num_accepted)]
        stop_hits, errors = set(), {}
        for row, seq in enumerate(plan.seqs):
            sample = samples[seq.request_id]
            req = self._table.requests[sample.parent]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = t0
                req.num_cached_tokens = seq.num_cached_tokens
            if seq.start_pos == 0:
                self._num_prompt_tokens += len(seq.token_ids)
            if not seq.sample or req.request_id in errors:
                continue
            tokens = scheduler.accepted_tokens(state.requests[seq.request_id], accepted[row])
            try:
                for j, token in enumerate(tokens):
                    if sample.append(token, float(result.logprobs[row, j]),
                                     result.top_ids[row, j], result.top_vals[row, j]):
                        stop_hits.add(seq.request_id)
                        tokens = tokens[:j + 1]
                        break
            except Exception as e:   # one request's bookkeeping must not stop the others
                errors[req.request_id] = f"{type(e).__name__}: {e}"
                continue
            accepted[row] = tokens
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            req.metrics.num_generated_tokens += len(tokens)
            self._num_generated += len(tokens)
            touched[req.request_id] = req
        return (touched, accepted,
                stop_hits - {s for s in stop_hits if samples[s].parent in errors}, errors)

    def _fail(self, request_id: str, error: str) -> dict[str, RequestOutput]:
        """Ends ``request_id`` with ``finish_reason="error"``: its blocks freed, its output
        carrying ``error``."""
        logger.warning("request %s failed: %s", request_id, error)
        state, seq_ids = self._state, self._table.seq_ids(request_id)
        for seq_id in seq_ids:
            if seq_id in state.requests:
                state = scheduler.abort(state, seq_id)
        self._state = dataclasses.replace(state, finished=types.MappingProxyType({
            k: v for k, v in state.finished.items() if k not in seq_ids}))
        self._num_errors += 1
        return {request_id: self._table.fail(request_id, error)}

    def _collect(self) -> dict[str, RequestOutput]:
        """The final outputs of the sequences the scheduler finished; the scheduler's
        ``finished`` map is emptied once read, so a request id is free again at once."""
        outs = {o.request_id: o for o in self._table.collect_finished(self._state.finished)}
        if self._state.finished:
            self._state = dataclasses.replace(self._state, finished=types.MappingProxyType({}))
        return outs

    # ------------------------------------------------------------------ drivers (beam search)

    @property
    def scheduler_state(self) -> SchedulerState:
        """The current (immutable) scheduler state."""
        return self._state

    def run(self, state: SchedulerState, plan: StepPlan,
            params: Sequence[SamplingParams]) -> StepOutput:
        """Runs a plan a driver scheduled itself from ``state`` (beam search): one
        ``SamplingParams`` per ``plan.seqs`` entry; the step's statistics are counted.

        The driver then hands its final state back with ``commit``.
        """
        self._check_open()
        rows = _rows(state, plan, params)
        self._count(plan, state)
        return self.runner.execute(plan, rows)

    def commit(self, state: SchedulerState) -> None:
        """Adopts a scheduler state a driver advanced from ``scheduler_state`` with sequences
        of its own (it must have released them all: none may be left that no request owns).

        Raises:
          ValueError: ``state`` holds sequences the request table does not know.
        """
        unknown = set(state.requests) - set(self._table.samples)
        if unknown:
            raise ValueError(f"commit: sequences {sorted(map(str, unknown))} are still live")
        self._state = state
        self._publish_kv_events()

    # ------------------------------------------------------------------ introspection

    def check_invariants(self) -> None:
        """Raises AssertionError unless the scheduler state, the block manager and the request
        table agree (every live sequence has its bookkeeping and vice versa)."""
        scheduler.check_invariants(self._state, self.sched_config)
        live = set(self._state.requests)
        if live != set(self._table.samples):
            raise AssertionError(f"scheduler sequences {sorted(live)} != request table "
                                 f"samples {sorted(self._table.samples)}")

    def reset_peak_usage(self) -> None:
        """Restarts ``stats()["kv_usage_peak"]`` from the current usage (per-phase peaks)."""
        self._peak_usage = self._state.block_manager.usage()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (running requests keep their blocks)."""
        self._publish_kv_events()   # what came before the reset's AllBlocksCleared
        bm = self._state.block_manager.copy()
        bm.reset_prefix_cache()
        host = self._state.host
        if host is not None:   # its prefix blocks too (the persistent cache on disk stays)
            host = host.copy()
            host.reset_prefix()
        self._state = dataclasses.replace(self._state, block_manager=bm, host=host)
        self._publish_kv_events()

    def stats(self) -> dict:
        """KV usage and throughput counters since start.

        Returns:
          dict with ``kv_blocks_total`` (usable, excluding the null block), ``kv_blocks_used``,
          ``kv_blocks_free``, ``kv_blocks_per_group`` (a hybrid cache's blocks held in each
          layer group's tables, ``jaxkv.config.kv_groups``), ``kv_usage`` (fraction), ``kv_usage_peak`` (highest fraction in any
          step), ``kv_tokens_live`` (tokens whose K/V is cached for live requests),
          ``num_running``, ``num_waiting`` (sequences: a request with ``n`` samples counts
          ``n``), ``num_requests_running`` (requests with a running sample),
          ``num_requests_waiting`` (the other live requests), ``num_preemptions``, ``num_steps``,
          ``num_prompt_tokens``, ``num_generated_tokens``, ``num_errors`` (requests ended with
          ``finish_reason="error"``), ``generation_tokens_per_s`` (generated tokens / time spent
          in steps), ``num_computed_tokens`` (tokens the device computed),
          ``prefix_cache_queries`` and ``prefix_cache_hits`` (tokens of admitted requests, and
          of those the tokens found in the prefix cache or shared by a fork),
          ``prefix_cache_hit_rate`` (their ratio), ``num_cached_blocks`` (blocks in the prefix
          cache, in use or free), ``host_time_fraction`` (share of step time spent on the host:
          scheduling, batch building, sampling tensors, detokenization; the rest is the jitted
          step), ``busy_time_s`` and ``device_time_s``, ``block_size`` and ``num_gpu_blocks``
          (the pool's blocks, the null block included, as vLLM counts them); with a host KV tier
          (``kv_offload_bytes``) the ``kv_offload_*`` counters (``offload_stats``); and the
          speculative decoding counters
          (``spec_*``, ``Speculator.stats``: drafts proposed, verified, accepted, acceptance
          rate, mean acceptance length); with ``kv_events_config`` the KV-cache event
          batches ``kv_events_batches`` (queued to the publisher) and
          ``kv_events_dropped_batches`` (dropped: its queue was full).
        """
        bm = self._state.block_manager
        total = self.cache_config.num_usable_blocks
        busy, device = self._busy_time, self.runner.device_time
        running = {self._table.samples[s].parent for s in self._state.running}   # request ids
        return {
            "kv_blocks_total": total,
            "kv_blocks_used": total - bm.num_free_blocks,
            "kv_blocks_per_group": bm.blocks_per_group(),
            "kv_blocks_free": bm.num_free_blocks,
            "kv_usage": bm.usage(),
            "kv_usage_peak": self._peak_usage,
            "kv_tokens_live": sum(rs.num_computed_tokens for rs in self._state.requests.values()),
            "num_running": len(self._state.running),
            "num_waiting": len(self._state.waiting),
            "num_requests_running": len(running),
            "num_requests_waiting": len(self._table.requests) - len(running),
            "num_preemptions": self._num_preemptions,
            "num_steps": self.runner.num_steps,
            "num_prompt_tokens": self._num_prompt_tokens,
            "num_generated_tokens": self._num_generated,
            "num_errors": self._num_errors,
            "num_computed_tokens": self._num_computed_tokens,
            "prefix_cache_queries": self._num_lookup_tokens,
            "prefix_cache_hits": self._num_hit_tokens,
            "prefix_cache_hit_rate": self._num_hit_tokens / self._num_lookup_tokens
            if self._num_lookup_tokens else 0.0,
            "num_cached_blocks": bm.num_cached_blocks,
            "generation_tokens_per_s": self._num_generated / busy if busy else 0.0,
            "host_time_fraction": 1.0 - device / busy if busy else 0.0,
            "busy_time_s": busy,
            "device_time_s": device,
            "block_size": self.cache_config.block_size,
            "num_gpu_blocks": self.cache_config.num_blocks,
        } | self.offload_stats() | self.speculator.stats() | self._kv_event_stats()

    def _kv_event_stats(self) -> dict:
        if self.kv_events is None:
            return {}
        return {"kv_events_batches": self.kv_events.num_published,
                "kv_events_dropped_batches": self.kv_events.num_dropped}

    def offload_stats(self) -> dict:
        """The host tier's counters ({} without one): ``kv_offload_blocks_total``, ``_prefix``
        (demoted prefix blocks held), ``_swapped`` (swapped sequences' blocks held),
        ``prefix_cache_hits_host`` / ``_disk`` (hit tokens by tier; ``prefix_cache_hits``
        counts every tier), ``num_swap_preemptions`` (of ``num_preemptions``),
        ``kv_offload_bytes_out`` / ``_in`` (copied so far), the start-up copy bandwidths
        ``kv_offload_d2h_bytes_per_s`` / ``_h2d_``, the fitted ``prefill_tokens_per_s``, and
        with ``kv_cache_dir`` the files ``kv_disk_blocks``, ``_written``, ``_loaded`` and
        ``_refused`` (corrupt or foreign files, logged and recomputed)."""
        offload, host = self.runner.offload, self._state.host
        if offload is None:
            return {}
        pool = offload.pool
        out = {
            "kv_offload_blocks_total": host.num_slots,
            "kv_offload_blocks_prefix": host.num_prefix_blocks,
            "kv_offload_blocks_swapped": host.num_swapped_blocks,
            "prefix_cache_hits_host": self._num_host_hit_tokens,
            "prefix_cache_hits_disk": self._num_disk_hit_tokens,
            "num_swap_preemptions": self._num_swapped,
            "kv_offload_bytes_out": pool.bytes_out,
            "kv_offload_bytes_in": pool.bytes_in,
            "kv_offload_d2h_bytes_per_s": offload.copy_bandwidth[0],
            "kv_offload_h2d_bytes_per_s": offload.copy_bandwidth[1],
            "prefill_tokens_per_s": self._prefill_rate,
        }
        disk = offload.disk
        if disk is not None:
            out |= {"kv_disk_blocks": len(disk), "kv_disk_written": disk.num_written,
                    "kv_disk_loaded": disk.num_loaded, "kv_disk_refused": disk.num_refused}
        return out

    def close(self) -> None:
        """Frees device memory; the engine cannot be used afterwards."""
        if not self._closed:
            pc = self._state.block_manager.prefix_cache
            if self.runner.offload is not None:
                self.runner.offload.flush(self.runner.cache,
                                          () if pc is None else pc.full_blocks())
            self.runner.close()
            self.speculator.close()
            if self.kv_events is not None:
                self._publish_kv_events()
                self.kv_events.close()
            self._closed = True


def _rows(state: SchedulerState, plan: StepPlan, params: Sequence[SamplingParams],
          matchers: Sequence[structured.Matcher | None] = ()) -> list[RowInput]:
    """The runner's per-row inputs of ``plan``: one ``SamplingParams`` per scheduled sequence,
    with that sequence's prompt and generated tokens from ``state``, and where it samples
    under a grammar (``matchers``: per sequence one, or None), the tokens the grammar allows
    at each position (after each of its drafts)."""
    rows = []
    for s, p, m in zip(plan.seqs, params, matchers or [None] * len(plan.seqs)):
        masks = None if m is None or not s.sample else m.bitmasks(
            s.token_ids[len(s.token_ids) - s.num_drafts:])
        rows.append(RowInput(p, state.requests[s.request_id].request.prompt_token_ids,
                             state.requests[s.request_id].output_token_ids, masks))
    return rows
