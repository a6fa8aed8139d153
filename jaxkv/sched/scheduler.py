"""Continuous-batching scheduler as pure functions over an immutable ``SchedulerState``.

    state = init_state(cache_config)
    state = add_request(state, request, scheduler_config)
    state, plan = schedule(state, scheduler_config, drafts)  # plan -> batch.build -> device step
    state = update(state, plan, accepted_tokens)           # append tokens, detect finished

Purity. The ``BlockManager`` is a *value* inside the state. A function that changes block ownership
(``schedule``, ``update``, ``abort``) first copies it (``BlockManager.copy``: three int32
[num_blocks] arrays and a dict of immutable tuples, once per call, not per operation), mutates only
the copy and returns it in a new state. A state, once returned, is never mutated, so every function
here is a function of its arguments: the same state can be scheduled twice for the same plan, and
tests can keep old states to compare. (The alternative, returning block *ops* for the engine to
apply, would leave the plan without real block tables and split the ownership truth in two.)

One counter per request. ``num_computed_tokens`` catches up with ``num_tokens`` (prompt + generated
tokens); there is no prefill or decode phase. A request with ``num_tokens - num_computed_tokens ==
1`` is what other engines call a decode. ``schedule`` advances the counter for the tokens it plans
(so two schedules without an update do not plan the same tokens twice); a sequence samples a token
when its chunk reaches the end of the known tokens, and ``update`` appends that token.

One step of ``schedule``:

  0. Retention (jaxkv/retention/): every running request first gives back the blocks no query
     from its next position on can see (StreamingLLM's out-of-window blocks), so they are free
     before anyone allocates; an admitted request does the same after taking a cached prefix.
     Admission bounds a request by the blocks its policy lets it hold at once
     (``Retention.max_blocks``), not by its whole length.
  1. Running requests, most urgent first, each gets ``min(remaining, budget)`` tokens, but budget
     is first reserved for every running decode, so prefill chunks only take what decodes leave.
     A request whose new tokens need blocks that are not free preempts the least urgent running
     request not yet scheduled this step, repeatedly; when it is itself the least urgent one,
     it preempts itself. Preemption is by recompute: the victim's blocks are freed, it returns to
     the waiting queue with ``num_computed_tokens = 0`` and keeps its generated tokens.
  2. If nobody was preempted, waiting requests are admitted in queue order, each with a prefill
     chunk ``min(remaining, budget)``, while the budget, ``max_num_seqs`` running requests and the
     free blocks allow; admission stops at the first request that does not fit (no overtaking).
     A request admitted for the first time needs blocks for this chunk only (vLLM V1, which
     allocates per chunk and relies on preemption): its prefill then runs beside the running
     decodes, where waiting for its whole prompt's blocks ran a pool that holds one long
     history one request at a time, prefill and every decode at batch 1 (issue 14's
     multi-turn replay). A request coming back from a preemption is admitted only when the
     free blocks hold all its known tokens (prompt and output so far, as many as its
     retention policy keeps at once; vLLM V0's whole-prompt check) plus one block of
     headroom per running request (a watermark): readmitted one chunk at a time, or into a
     pool it fills exactly, it is the first victim of the next block any running request
     needs, and thrashes, each round recomputing everything it had (273 preemptions for 16
     requests in bench/offload.py's preemption workload).
  3. Draft tokens (speculative decoding, jaxkv/spec_decode/speculator.py): a running decode offered
     drafts in ``schedule(..., drafts)`` carries as many of them as the budget and the free blocks
     *left by steps 1 and 2* allow, and at most ``max_tokens - generated - 1`` (so even a fully
     accepted run stays within ``max_tokens``). Drafts never preempt nor delay a prefill chunk.

Multi-token steps. A decode with ``k`` drafts is scheduled as ``1 + k`` query tokens (its last
token, then the drafts) and samples ``1 + k`` rows: row ``j`` predicts the token after draft ``j``.
``schedule`` advances its counter past the drafts (``RequestState.num_draft_tokens`` says by how
much it is beyond ``num_tokens``); ``update`` takes the tokens the step accepted (1 to ``1 + k``:
the accepted drafts and the bonus or correction token), checks the stop rules on each in order
(tokens after the one that stops are dropped), and rewinds the counter over the rejected drafts,
to ``num_tokens - 1``, as vLLM does: their K/V slots are simply overwritten later. It also gives
back the blocks only rejected drafts needed (``BlockManager.truncate``, in reverse plan order, so
the free queue is as if they had never been taken), so tables and prefix-cache registration only
ever reflect verified tokens.

Prefix caching and forks (jaxkv/blocks/prefix_cache.py, jaxkv/blocks/block_manager.py). At
admission a request takes the longest cached prefix of its first ``num_tokens - 1`` tokens (the
last token is always computed: its logits are needed) and starts with ``num_computed_tokens``
there; a radix hit that ends inside a block adds a ``(src, dst)`` copy to ``plan.copy_ops``. A
request with ``fork_of`` (sample ``i > 0`` of ``n``) waits until its parent has computed all but
the last prompt token, then shares those blocks and computes only the rest. A running request about
to write into a block another table shares (a fork's or beam's last block) first copies it
(copy-on-write). The engine applies ``copy_ops`` on device before the step. ``update`` registers
the blocks a step filled, so only computed K/V is ever found by a lookup.

Urgency is the policy key: FCFS ``(arrival_time, n)``, priority ``(priority, arrival_time, n)``
(``n`` = order of ``add_request``, lower key = more urgent); ``lpm`` keeps FCFS queues but admits
the waiting request with the longest cached prefix first, except that one overtaken
``lpm_max_skips`` times goes first (SGLang's longest-prefix-match, with an age bound). The waiting
and running queues are kept sorted by it, so a preempted request, which keeps its key, goes back to
the front of the waiting queue under FCFS, and to its priority's place under the priority policy.

No deadlock, no loss: ``add_request`` rejects a request whose prompt + ``max_tokens`` exceeds
``max_model_len`` or the usable pool, so the most urgent running request can always get its blocks
by preempting every other one, and it is never chosen as a victim by anyone else; every step makes
progress and every request eventually finishes or is aborted.

Finishing (``update``): a sampled stop token or eos (unless ``ignore_eos``) once ``min_tokens``
tokens exist, or ``max_tokens`` generated tokens, or an id the engine passes in ``finished_ids``
(stop strings, found by its detokenizer). Finished and aborted requests free their blocks at once,
wait in ``state.finished`` for the engine to read, and are listed in the next plan's
``finished_ids``.
"""

from __future__ import annotations

import bisect
import dataclasses
import types
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from jaxkv.blocks import host_tier
from jaxkv.blocks.block_manager import NULL_BLOCK, BlockManager
from jaxkv.blocks.host_tier import NO_SLOT, HostTier, SwapCostModel
from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.retention import FullRetention, Retention

FINISH_STOP = "stop"      # stop token, eos, or the engine's stop string
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_ABORT = "abort"    # abort()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopSpec:
    """When a request stops generating.

    Attributes:
      max_tokens: most tokens to generate (>= 1).
      min_tokens: stop and eos tokens are ignored until this many tokens are generated.
      stop_token_ids: tokens that end generation (the token is kept in the output).
      ignore_eos: keep generating through ``eos_token_ids``.
      eos_token_ids: the model's end-of-sequence tokens.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be in [0, max_tokens="
                             f"{self.max_tokens}]")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """A generation request as submitted.

    Attributes:
      request_id: any hashable id, unique among live requests.
      prompt_token_ids: the prompt (non-empty).
      stop: stopping rule.
      arrival_time: FCFS order (and the priority tie-break).
      priority: lower number = more urgent (used by the ``"priority"`` policy).
      cache_salt: prefix-cache namespace; requests share cached blocks only with equal salts.
      fork_of: id of a request with the same prompt whose prompt blocks this one shares
        (parallel sampling); it should be added after it.
    """

    request_id: Hashable
    prompt_token_ids: tuple[int, ...]
    stop: StopSpec = StopSpec()
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: Hashable = None
    fork_of: Hashable = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids of request {self.request_id!r} must not be empty")


@dataclasses.dataclass(frozen=True)
class RequestState:
    """A request and its progress.

    Attributes:
      request: as submitted.
      order: position in ``add_request`` order (the last tie-break of the policy key).
      output_token_ids: generated tokens.
      num_computed_tokens: tokens whose K/V is (being) written to the cache.
      finish_reason: None while live, else ``"stop"``, ``"length"`` or ``"abort"``.
      num_cached_tokens: tokens taken from the prefix cache or a fork at the first admission.
      num_skipped: times a later request was admitted before this waiting one (``lpm``).
      num_draft_tokens: draft tokens planned by the last ``schedule`` and not yet verified by
        ``update``; ``num_computed_tokens`` counts them, so it may exceed ``num_tokens`` by this.
      block_scores: f64 [blocks so far] attention mass each logical block received, summed
        over the steps since admission (policies with ``Retention.observe``; else None).
      first_drop: with a history-dependent policy (H2O), the position of the next query when
        the request first dropped a block: only blocks below it are registered in the prefix
        cache (their KV is a function of the tokens alone).
      swapped_tokens: > 0 while the request waits swapped out (swap preemption): the computed
        tokens whose blocks the host tier holds (``HostTier.swapped``); it resumes there.
      num_preemptions: times it was preempted (by recompute or swap).
    """

    request: Request
    order: int
    output_token_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    num_skipped: int = 0
    num_draft_tokens: int = 0
    block_scores: np.ndarray | None = dataclasses.field(default=None, compare=False)
    first_drop: int | None = None
    swapped_tokens: int = 0
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, stop: int) -> tuple[int, ...]:
        """Tokens ``[start, stop)`` of prompt + output."""
        prompt = self.request.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):stop - len(prompt)]
        return prompt[start:] + self.output_token_ids[:stop - len(prompt)]


@dataclasses.dataclass(frozen=True)
class SchedulerState:
    """Everything the scheduler knows. Never mutated; every function returns a new one.

    Attributes:
      block_manager: block ownership; tables exist exactly for the running requests.
      requests: live (waiting or running) requests by id.
      waiting: ids without blocks, most urgent first (policy key order).
      running: ids with blocks, most urgent first (policy key order).
      finished: requests finished or aborted since the last ``schedule``, by id.
      num_added: requests added so far (the next ``RequestState.order``).
      retention: the KV retention policy (jaxkv/retention/): which blocks ``schedule`` gives
        back before allocating, and how many a request may hold.
      host: the host KV tier (jaxkv/blocks/host_tier.py): demoted prefix blocks and swapped-out
        sequences; None without one.
      preemption_mode: ``"recompute"``, ``"swap"`` or ``"auto"`` (``CacheConfig``).
      swap_supported: whether the pool's blocks can be swapped exactly (not KIVI).
      cost: the swap-or-recompute cost model ``"auto"`` decides by; the engine refits it from
        its measurements (``with_cost_model``).
    """

    block_manager: BlockManager
    requests: Mapping[Hashable, RequestState]
    waiting: tuple[Hashable, ...] = ()
    running: tuple[Hashable, ...] = ()
    finished: Mapping[Hashable, RequestState] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))
    num_added: int = 0
    retention: Retention = FullRetention()
    host: HostTier | None = None
    preemption_mode: str = "recompute"
    swap_supported: bool = True
    cost: SwapCostModel | None = None


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """One sequence of a step.

    Attributes:
      request_id: whose tokens these are.
      token_ids: tokens to compute this step (>= 1), draft tokens last.
      start_pos: position of ``token_ids[0]`` in the sequence (= tokens already computed).
      sample: whether a token is sampled after the last one (the chunk reaches the known end).
      block_table: the request's physical blocks; they cover every position up to
        ``start_pos + len(token_ids) - 1``.
      num_cached_tokens: at an admission, the tokens ``[0, start_pos)`` taken from the prefix
        cache or a fork (0 otherwise).
      num_drafts: the last ``num_drafts`` of ``token_ids`` are proposed draft tokens, not yet
        part of the request (only on a decode: then ``sample`` is true and the step samples
        ``1 + num_drafts`` rows for this sequence).
    """

    request_id: Hashable
    token_ids: tuple[int, ...]
    start_pos: int
    sample: bool
    block_table: tuple[int, ...]
    num_cached_tokens: int = 0
    num_drafts: int = 0


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one engine step computes.

    Attributes:
      seqs: scheduled sequences, in scheduling order (row ``i`` of the step's outputs).
      preempted_ids: requests preempted (blocks freed, back to waiting) by this schedule.
      finished_ids: requests finished or aborted since the previous schedule.
      copy_ops: ``(src, dst)`` block copies to apply, all at once, before the step.
      num_lookup_tokens: tokens of the requests admitted this step with a prefix-cache lookup
        or a fork.
      num_hit_tokens: of those, tokens found in the prefix cache (or shared by a fork), on any
        tier.
      swap_out: ``(block, slot, key)`` device block -> host slot copies, applied first (``key``:
        the prefix key of a demoted cached block, also written to the persistent cache; None
        for a swapped sequence's block or a radix partial block).
      disk_loads: ``(slot, row)`` persistent-cache rows (uint8 [block_bytes]) to put in host
        slots, after the swap-outs.
      swap_in: ``(slot, block)`` host slot -> device block copies, after the disk loads and
        before ``copy_ops``.
      swapped_ids: of ``preempted_ids``, those swapped out (the others recompute).
      num_host_hit_tokens: of ``num_hit_tokens``, tokens promoted from the host tier (disk
        included).
      num_disk_hit_tokens: of those, tokens read from the persistent cache.
      observe: whether the step returns the attention mass per block: some sampling
        sequence's retention policy wants it (``Retention.wants_scores``); the engine runs
        the step without computing it otherwise.
    """

    seqs: tuple[ScheduledSeq, ...]
    preempted_ids: tuple[Hashable, ...] = ()
    finished_ids: tuple[Hashable, ...] = ()
    copy_ops: tuple[tuple[int, int], ...] = ()
    num_lookup_tokens: int = 0
    num_hit_tokens: int = 0
    swap_out: tuple[tuple[int, int, Hashable], ...] = ()
    disk_loads: tuple[tuple[int, np.ndarray], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    swapped_ids: tuple[Hashable, ...] = ()
    num_host_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0
    observe: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_drafts(self) -> int:
        """Draft tokens the step verifies."""
        return sum(s.num_drafts for s in self.seqs)


def init_state(cache_config: CacheConfig, disk=None) -> SchedulerState:
    """An empty scheduler state over a fresh pool of ``cache_config.num_blocks`` blocks (and a
    host tier of ``cache_config.host_blocks``, with ``disk``, a
    ``jaxkv.kvcache.disk_store.DiskKVStore``, behind it)."""
    bm = BlockManager(cache_config.num_blocks, cache_config.block_size,
                      cache_config.prefix_caching, cache_config.residual_window_blocks)
    host = None
    if cache_config.host_blocks:
        host = HostTier(cache_config.host_blocks, disk)
        bm.record_evictions = bm.prefix_cache is not None
    return SchedulerState(bm, types.MappingProxyType({}), retention=cache_config.retention,
                          host=host, preemption_mode=cache_config.preemption_mode,
                          swap_supported=cache_config.swap_supported)


def with_cost_model(state: SchedulerState, cost: SwapCostModel) -> SchedulerState:
    """``state`` deciding swap or recompute by ``cost`` from now on."""
    return dataclasses.replace(state, cost=cost)


def _key(rs: RequestState, policy: str) -> tuple:
    """Policy key: lower = more urgent."""
    if policy == "priority":
        return (rs.request.priority, rs.request.arrival_time, rs.order)
    return (rs.request.arrival_time, rs.order)


def _free(bm: BlockManager, rs: RequestState) -> None:
    """Free ``rs``'s blocks, offering its computed partial last block to the prefix cache."""
    computed = rs.num_computed_tokens - rs.num_draft_tokens
    tail = computed % bm.block_size
    bm.free(rs.request.request_id, rs.token_ids(computed - tail, computed) if tail else ())


def _register(bm: BlockManager, rs: RequestState, computed: int) -> None:
    """Cache ``rs``'s full blocks below position ``computed``, whose K/V is computed (and below
    its first drop, see ``RequestState.first_drop``)."""
    if rs.first_drop is not None:
        computed = min(computed, rs.first_drop)
    bs = bm.block_size
    first = bm.num_registered(rs.request.request_id)
    if computed // bs > first:
        bm.register(rs.request.request_id, rs.token_ids(first * bs, computed // bs * bs))


def _retain(bm: BlockManager, retention: Retention, rs: RequestState) -> RequestState:
    """``rs`` after giving back the blocks ``retention`` drops before its next query (at
    ``num_computed_tokens``; the null block takes their table entries)."""
    request_id, at = rs.request.request_id, rs.num_computed_tokens
    if retention.history_dependent and at < len(rs.request.prompt_token_ids):
        return rs   # the prompt is computed with full attention first
    drops = retention.drops(at, bm.block_table(request_id), rs.block_scores, bm.block_size,
                            prompt_tokens=len(rs.request.prompt_token_ids))
    if not drops:
        return rs
    bm.release_blocks(request_id, drops)
    if retention.history_dependent and rs.first_drop is None:
        return dataclasses.replace(rs, first_drop=at)
    return rs


def _sees_kept(table: Sequence[int], num_computed: int, retention: Retention,
               block_size: int) -> bool:
    """Whether every block of ``table`` a query at ``num_computed`` may still see is kept."""
    return all(b != 0 or retention.may_drop(num_computed, j, block_size)
               for j, b in enumerate(table))


def _insert(queue: list, request_id: Hashable, requests: Mapping, policy: str) -> None:
    """Insert into a key-sorted id list, after equal keys."""
    keys = [_key(requests[i], policy) for i in queue]
    queue.insert(bisect.bisect_right(keys, _key(requests[request_id], policy)), request_id)


def add_request(state: SchedulerState, request: Request,
                config: SchedulerConfig) -> SchedulerState:
    """Queue ``request``.

    Raises:
      ValueError: the id is already live; prompt + ``max_tokens`` exceeds ``max_model_len``;
        or the whole sequence could never fit the pool's usable blocks.
    """
    bm = state.block_manager
    if request.request_id in state.requests:
        raise ValueError(f"request_id={request.request_id!r} is already queued or running")
    total = len(request.prompt_token_ids) + request.stop.max_tokens
    if total > config.max_model_len:
        raise ValueError(
            f"request {request.request_id!r}: len(prompt_token_ids) + max_tokens = {total} "
            f"exceeds max_model_len={config.max_model_len}")
    need = state.retention.max_blocks(total, config.max_num_batched_tokens, bm.block_size,
                                      len(request.prompt_token_ids))
    if need > bm.num_blocks - 1:
        raise ValueError(
            f"request {request.request_id!r}: len(prompt_token_ids) + max_tokens = {total} "
            f"tokens need {need} blocks at once but the pool has "
            f"num_blocks - 1 = {bm.num_blocks - 1} usable blocks")
    requests = dict(state.requests)
    requests[request.request_id] = RequestState(request, state.num_added)
    waiting = list(state.waiting)
    _insert(waiting, request.request_id, requests, config.policy)
    return dataclasses.replace(state, requests=types.MappingProxyType(requests),
                               waiting=tuple(waiting), num_added=state.num_added + 1)


def decoding_ids(state: SchedulerState) -> tuple[Hashable, ...]:
    """Running requests whose next step computes only their last token (decodes: the ones
    that can carry draft tokens), most urgent first."""
    return tuple(i for i in state.running
                 if state.requests[i].num_tokens - state.requests[i].num_computed_tokens == 1)


def schedule(state: SchedulerState, config: SchedulerConfig,
             drafts: Mapping[Hashable, Sequence[int]] = types.MappingProxyType({})
             ) -> tuple[SchedulerState, StepPlan]:
    """Plan one step (see the module docstring); returns the new state and the plan.

    Args:
      drafts: proposed draft tokens by request id; a running decode takes what fits of its
        own (step 3 of the module docstring), every other entry is ignored.
    """
    bm = state.block_manager.copy()
    requests = dict(state.requests)
    waiting = list(state.waiting)
    running = list(state.running)
    budget = config.max_num_batched_tokens
    scheduled: list[tuple[Hashable, int]] = []  # (request id, new tokens)
    preempted: list[Hashable] = []
    decodes: set[Hashable] = set()               # running requests scheduled one last token

    def remaining(request_id):
        rs = requests[request_id]
        return rs.num_tokens - rs.num_computed_tokens

    copy_ops: list[tuple[int, int]] = []
    cached: dict[Hashable, int] = {}   # admitted this step: tokens taken from cache / fork
    num_lookup = num_host_hits = num_disk_hits = 0
    host = None if state.host is None else state.host.copy()
    if host is not None:
        host.begin_plan()
    swap_out: list[tuple[int, int, Hashable]] = []
    swap_in: list[tuple[int, int]] = []
    disk_loads: list[tuple[int, np.ndarray]] = []
    swapped: list[Hashable] = []

    def preempt(request_id):
        rs = requests[request_id]
        rs = dataclasses.replace(rs, num_preemptions=rs.num_preemptions + 1)
        ops = _swap_out(state, bm, host, rs)
        _free(bm, rs)
        if ops is None:   # recompute: start again from the prompt (and the prefix cache)
            requests[request_id] = dataclasses.replace(rs, num_computed_tokens=0,
                                                       num_draft_tokens=0, block_scores=None,
                                                       first_drop=None)
        else:             # swap: the host tier holds its blocks until it resumes
            swap_out.extend(ops)
            swapped.append(request_id)
            requests[request_id] = dataclasses.replace(rs, num_computed_tokens=0,
                                                       swapped_tokens=rs.num_computed_tokens)
        running.remove(request_id)
        _insert(waiting, request_id, requests, config.policy)
        preempted.append(request_id)

    # 0. retention: blocks no later query of a running request sees go back to the pool first
    for request_id in running:
        requests[request_id] = _retain(bm, state.retention, requests[request_id])

    # 1. running requests, most urgent first; victims are taken from the least urgent end.
    queue = deque(running)
    reserved = sum(remaining(i) == 1 for i in queue)  # budget kept for decodes not yet visited
    while queue and budget > 0:
        request_id = queue.popleft()
        left = remaining(request_id)
        if left == 1:
            reserved -= 1
            n = 1
        else:
            n = min(left, budget - reserved)
            if n <= 0:
                continue
        start = requests[request_id].num_computed_tokens
        new_total = start + n
        while not bm.can_append_slots(request_id, new_total, write_from=start):
            victim = queue.pop() if queue else request_id
            if victim != request_id and remaining(victim) == 1:
                reserved -= 1
            preempt(victim)
            if victim == request_id:
                break
        if request_id in preempted:
            continue
        op = bm.copy_on_write(request_id, start)
        if op is not None:
            copy_ops.append(op)
        bm.append_slots(request_id, new_total)
        scheduled.append((request_id, n))
        if left == 1:
            decodes.add(request_id)
        budget -= n

    # 2. admit waiting requests with a prefill chunk, unless this step had to preempt.
    candidates = list(waiting)
    if config.policy == "lpm" and not preempted:
        bs = bm.block_size

        def lpm_key(i):
            rs = requests[i]
            blocks, _, partial = bm.lookup(rs.token_ids(0, rs.num_tokens - 1),
                                           rs.request.cache_salt)
            hit = len(blocks) * bs + (partial[1] if partial else 0)
            return (rs.num_skipped < config.lpm_max_skips, -hit)
        candidates.sort(key=lpm_key)   # stable: FCFS among equals
    admitted: list[Hashable] = []

    def hold(rs, chunk_end):   # tokens admission must find room for
        if not rs.num_preemptions:   # first admission: this chunk only, no watermark
            return chunk_end
        bound = state.retention.max_blocks(rs.num_tokens, config.max_num_batched_tokens,
                                           bm.block_size, len(rs.request.prompt_token_ids))
        return max(chunk_end, min(rs.num_tokens, bound * bm.block_size))

    for request_id in candidates:
        if preempted or budget <= 0 or len(running) >= config.max_num_seqs:
            break
        rs = requests[request_id]
        # readmitted after a preemption: also a block of headroom for every running request
        reserve = len(running) if rs.num_preemptions else 0
        if rs.swapped_tokens:   # swapped out: its blocks come back from the host tier
            n = min(rs.num_tokens - rs.swapped_tokens, budget)
            slots = host.swapped(request_id)
            kept = [slot != NO_SLOT for slot in slots]
            if not bm.can_allocate_layout(kept, hold(rs, rs.swapped_tokens + n),
                                          reserve=reserve):
                break
            table = bm.allocate_layout(request_id, kept, rs.swapped_tokens + n,
                                       salt=rs.request.cache_salt)
            host.swap_in(request_id)
            swap_in.extend((slot, b) for slot, b in zip(slots, table) if slot != NO_SLOT)
            requests[request_id] = _retain(bm, state.retention, dataclasses.replace(
                rs, num_computed_tokens=rs.swapped_tokens, swapped_tokens=0))
            waiting.remove(request_id)
            admitted.append(request_id)
            _insert(running, request_id, requests, config.policy)
            scheduled.append((request_id, n))
            budget -= n
            continue
        parent = rs.request.fork_of
        hit, host_hits = None, ()
        if parent in state.requests:
            prs = state.requests[parent]
            p = len(rs.request.prompt_token_ids)
            if parent not in state.running or prs.num_computed_tokens < p - 1:
                continue   # the parent's prompt is not computed yet: wait (others may pass)
            hit, keys, partial = bm.block_table(parent)[:bm.blocks_for(p - 1)], None, None
            num_cached = p - 1
            if not _sees_kept(hit, num_cached, state.retention, bm.block_size):
                hit = None   # the parent already dropped blocks the fork sees: compute afresh
        if hit is None:   # the prompt's last observed tokens (SnapKV's window) are computed
            last = max(0, rs.num_tokens - max(1, state.retention.observe))
            hit, keys, partial, host_hits = host_tier.lookup(   # device, then host tier and disk
                bm, host, rs.token_ids(0, last), rs.request.cache_salt)
            disk_loads.extend((slot, row) for slot, _, row in host_hits if row is not None)
            num_cached = (len(hit) * bm.block_size + sum(len(t) for _, t, _ in host_hits)
                          + (partial[1] if partial else 0))
        n = min(rs.num_tokens - num_cached, budget)
        if keys is None:   # fork: share the parent's blocks, copy the last one if partial
            need = (bm.blocks_for(hold(rs, num_cached + n)) - len(hit)
                    + (num_cached % bm.block_size > 0))
            if need + reserve > bm.num_free_blocks:
                break
            bm.fork(parent, request_id, len(hit))
            op = bm.copy_on_write(request_id, num_cached)
            bm.append_slots(request_id, num_cached + n)
        else:
            if not bm.can_allocate_cached(hold(rs, num_cached + n), hit, partial,
                                          reserve=reserve):
                break
            table, op = bm.allocate_cached(request_id, num_cached + n, hit, keys[:len(hit)],
                                           partial, salt=rs.request.cache_salt,
                                           promoted=len(host_hits))
            if host_hits:   # promoted: fresh blocks filled from the host, full ones cached
                swap_in.extend((slot, table[len(hit) + i])
                               for i, (slot, _, _) in enumerate(host_hits))
                bm.register(request_id, sum((tokens for _, tokens, _ in host_hits), ()))
                num_host_hits += sum(len(tokens) for _, tokens, _ in host_hits)
                num_disk_hits += sum(row is not None for *_, row in host_hits) * bm.block_size
        if op is not None:
            copy_ops.append(op)
        if bm.prefix_cache is not None or keys is None:
            num_lookup += rs.num_tokens
        cached[request_id] = num_cached
        inherited = {}
        if keys is None:   # a fork starts from its parent's drops and scores
            inherited = dict(first_drop=prs.first_drop, block_scores=None
                             if prs.block_scores is None else prs.block_scores[:len(hit)].copy())
        requests[request_id] = _retain(bm, state.retention, dataclasses.replace(
            rs, num_computed_tokens=num_cached,
            num_cached_tokens=rs.num_cached_tokens or num_cached, **inherited))
        waiting.remove(request_id)
        admitted.append(request_id)
        _insert(running, request_id, requests, config.policy)
        scheduled.append((request_id, n))
        budget -= n
    if admitted:
        last = max(_key(requests[i], config.policy) for i in admitted)
        for i in waiting:
            if _key(requests[i], config.policy) < last:
                requests[i] = dataclasses.replace(requests[i],
                                                  num_skipped=requests[i].num_skipped + 1)

    # 3. decodes take their drafts from what is left (the decode token's slot is already there)
    taken: dict[Hashable, tuple[int, ...]] = {}
    for request_id in (i for i, _ in scheduled if i in decodes and drafts.get(i)):
        rs = requests[request_id]
        end = rs.num_tokens   # slots for positions < end exist; drafts go at end, end + 1, ...
        room = (len(bm.block_table(request_id)) + bm.num_free_blocks) * bm.block_size - end
        k = min(len(drafts[request_id]), budget, room,
                rs.request.stop.max_tokens - len(rs.output_token_ids) - 1)
        if k > 0:
            bm.append_slots(request_id, end + k)
            taken[request_id] = tuple(int(t) for t in drafts[request_id][:k])
            budget -= k

    seqs = []
    observe = False
    for request_id, n in scheduled:
        rs = requests[request_id]
        start = rs.num_computed_tokens
        draft = taken.get(request_id, ())
        sample = start + n == rs.num_tokens
        observe |= sample and state.retention.wants_scores(
            len(rs.request.prompt_token_ids), rs.first_drop, bm.block_size)
        seqs.append(ScheduledSeq(request_id, rs.token_ids(start, start + n) + draft, start,
                                 sample, bm.block_table(request_id),
                                 cached.get(request_id, 0), len(draft)))
        requests[request_id] = dataclasses.replace(rs, num_computed_tokens=start + n + len(draft),
                                                   num_draft_tokens=len(draft))
    bm.release_copy_sources()   # no allocation of this plan is left to overwrite them
    if host is not None:   # cached blocks reused this step: their KV moves to the host tier
        swap_out.extend(host_tier.demote_evictions(bm, host))
    plan = StepPlan(tuple(seqs), tuple(preempted), tuple(state.finished), tuple(copy_ops),
                    num_lookup, sum(cached.values()), tuple(swap_out), tuple(disk_loads),
                    tuple(swap_in), tuple(swapped), num_host_hits, num_disk_hits, observe)
    return dataclasses.replace(state, block_manager=bm, requests=types.MappingProxyType(requests),
                               waiting=tuple(waiting), running=tuple(running),
                               finished=types.MappingProxyType({}), host=host), plan


def _swap_out(state: SchedulerState, bm: BlockManager, host: HostTier | None,
              rs: RequestState) -> tuple[tuple[int, int, None], ...] | None:
    """The swap-outs preempting ``rs`` by swap, or None to recompute it: no host tier or room,
    a pool that cannot swap, ``preemption_mode="recompute"``, or under ``"auto"`` a cost
    model that does not estimate copying its kept blocks out and back faster than recomputing
    its tokens beyond the ones its registered blocks would give back as prefix hits."""
    if host is None or not state.swap_supported or state.preemption_mode == "recompute":
        return None
    request_id = rs.request.request_id
    table = bm.block_table(request_id)
    if state.preemption_mode == "auto":
        uncached = rs.num_computed_tokens - bm.num_registered(request_id) * bm.block_size
        kept = sum(b != NULL_BLOCK for b in table)
        if state.cost is None or not state.cost.prefers_swap(kept, uncached):
            return None
    return host.swap_out(request_id, table)


def _add_scores(rs: RequestState, mass: np.ndarray, num_blocks: int) -> RequestState:
    """``rs`` with one step's attention mass of its first ``num_blocks`` blocks added."""
    scores = np.zeros(num_blocks)
    if rs.block_scores is not None:
        scores[:len(rs.block_scores)] = rs.block_scores[:num_blocks]
    scores += np.asarray(mass[:num_blocks], np.float64)
    return dataclasses.replace(rs, block_scores=scores)


def _stop_reason(stop: StopSpec, token: int, n: int) -> str | None:
    """Why a request stops after generating ``token`` as its ``n``-th output token, or None."""
    if n >= stop.min_tokens and (token in stop.stop_token_ids or (
            not stop.ignore_eos and token in stop.eos_token_ids)):
        return FINISH_STOP
    if n >= stop.max_tokens:
        return FINISH_LENGTH
    return None


def accepted_tokens(rs: RequestState, tokens: Iterable[int]) -> tuple[int, ...]:
    """The tokens ``rs`` appends of a step's ``tokens``, in order: all of them, or those up to
    and including the first one that finishes it (a stop or eos token once ``min_tokens`` exist,
    the ``max_tokens``-th token); the rest are dropped. ``update`` appends exactly these, and
    the engine hands the same ones to its detokenizer."""
    out: list[int] = []
    n = len(rs.output_token_ids)
    for token in tokens:
        out.append(int(token))
        if _stop_reason(rs.request.stop, out[-1], n + len(out)) is not None:
            break
    return tuple(out)


def _finish(state: SchedulerState, reasons: Mapping[Hashable, str],
            requests: dict[Hashable, RequestState]) -> SchedulerState:
    """A state where the live requests in ``reasons`` are finished with those reasons."""
    bm = state.block_manager.copy()
    host = state.host
    finished = dict(state.finished)
    for request_id, reason in reasons.items():
        if request_id in bm:
            _free(bm, requests[request_id])
        elif requests[request_id].swapped_tokens:   # waiting swapped out: its host slots go
            host = host.copy() if host is state.host else host
            host.drop(request_id)
        finished[request_id] = dataclasses.replace(requests.pop(request_id),
                                                   finish_reason=reason)
    return dataclasses.replace(
        state, block_manager=bm, requests=types.MappingProxyType(requests), host=host,
        waiting=tuple(i for i in state.waiting if i not in reasons),
        running=tuple(i for i in state.running if i not in reasons),
        finished=types.MappingProxyType(finished))


def update(state: SchedulerState, plan: StepPlan,
           sampled_tokens: Sequence[int | Sequence[int]],
           finished_ids: frozenset[Hashable] = frozenset(),
           block_mass: np.ndarray | None = None) -> SchedulerState:
    """Append the step's accepted tokens and finish the requests that stop.

    Args:
      state: the state ``schedule`` returned with ``plan`` (or a later one: sequences whose
        request is no longer live, e.g. aborted meanwhile, are skipped).
      plan: the step's plan.
      sampled_tokens: ``[>= len(plan.seqs)]``; row ``i`` is read only where
        ``plan.seqs[i].sample`` is true: the token sampled for it (an int), or its accepted
        tokens in order (a sequence of 1 to ``1 + num_drafts`` ints: the drafts the step
        accepted, then its bonus or correction token). Each is checked against the stop rules
        in order (``accepted_tokens``); padding rows beyond ``len(plan.seqs)`` are ignored.
      finished_ids: live requests the engine declares finished (e.g. a stop string matched);
        they finish with reason ``"stop"`` after this step's tokens are appended (one that also
        stopped on a token this step keeps that reason).
      block_mass: f32 [>= len(plan.seqs), max_blocks] the step's attention mass per logical
        block of each sequence (``jaxkv.attention.mass``), added to its ``block_scores``; None
        when the retention policy needs no scores.

    A sequence that verified drafts has its counter rewound to the verified tokens
    (``num_tokens - 1``) and its blocks beyond them given back; the prefix cache registers the
    full blocks below the verified tokens only.
    """
    if len(sampled_tokens) < len(plan.seqs):
        raise ValueError(f"sampled_tokens has {len(sampled_tokens)} rows, "
                         f"the plan has {len(plan.seqs)} seqs")
    requests = dict(state.requests)
    bm = state.block_manager
    reasons: dict[Hashable, str] = {}
    computed: dict[Hashable, int] = {}   # request id -> its verified computed tokens
    for row, seq in enumerate(plan.seqs):
        if seq.request_id not in requests:
            continue
        rs = requests[seq.request_id]
        computed[seq.request_id] = seq.start_pos + len(seq.token_ids) - seq.num_drafts
        if block_mass is not None:
            rs = requests[seq.request_id] = _add_scores(rs, block_mass[row],
                                                        len(seq.block_table))
        if not seq.sample:
            continue
        row_tokens = sampled_tokens[row]
        row_tokens = tuple(row_tokens) if isinstance(row_tokens, Iterable) else (row_tokens,)
        if not 1 <= len(row_tokens) <= 1 + seq.num_drafts:
            raise ValueError(f"sampled_tokens[{row}] has {len(row_tokens)} tokens; seq "
                             f"{seq.request_id!r} takes 1 to 1 + num_drafts = "
                             f"{1 + seq.num_drafts}")
        tokens = accepted_tokens(rs, row_tokens)
        rs = dataclasses.replace(rs, output_token_ids=rs.output_token_ids + tokens)
        if seq.num_drafts:   # rewind over the rejected drafts
            computed[seq.request_id] += len(tokens) - 1
            rs = dataclasses.replace(rs, num_computed_tokens=computed[seq.request_id],
                                     num_draft_tokens=0)
        requests[seq.request_id] = rs
        reason = _stop_reason(rs.request.stop, tokens[-1], len(rs.output_token_ids))
        if reason is not None:
            reasons[seq.request_id] = reason
    bs = bm.block_size
    register = [i for i, n in computed.items() if bm.prefix_cache is not None and i in bm
                and n // bs > bm.num_registered(i)]
    truncate = [s.request_id for s in reversed(plan.seqs) if s.num_drafts
                and s.request_id in computed and s.request_id in bm
                and bm.blocks_for(computed[s.request_id]) < len(bm.block_table(s.request_id))]
    if register or truncate:   # copy the manager only then
        bm = bm.copy()
        for request_id in register:   # cache the blocks this step filled and verified
            _register(bm, requests[request_id], computed[request_id])
        for request_id in truncate:   # reverse plan order: the free queue as before the drafts
            bm.truncate(request_id, computed[request_id])
        state = dataclasses.replace(state, block_manager=bm)
    for request_id in finished_ids:
        if request_id not in requests:
            raise ValueError(f"finished_ids names request_id={request_id!r}, "
                             f"which is not queued or running")
        reasons.setdefault(request_id, FINISH_STOP)
    if not reasons:
        return dataclasses.replace(state, requests=types.MappingProxyType(requests))
    return _finish(state, reasons, requests)


def abort(state: SchedulerState, request_id: Hashable) -> SchedulerState:
    """Finish a queued or running request with reason ``"abort"``, freeing its blocks at once."""
    if request_id not in state.requests:
        raise ValueError(f"request_id={request_id!r} is not queued or running")
    return _finish(state, {request_id: FINISH_ABORT}, dict(state.requests))


def fork(state: SchedulerState, config: SchedulerConfig,
         forks: Sequence[tuple[Hashable, Hashable, int]],
         release: Sequence[Hashable] = ()) -> SchedulerState:
    """Beam-search step: new running requests that share their parents' blocks, then drop some.

    Call it after the step that computed the parents' tokens (their filled blocks are cached
    here, since ``update`` skips released requests).

    Args:
      forks: ``(parent_id, child_id, token)``: the child is the running parent (all of whose
        tokens are computed) with ``token`` appended, sharing every parent block; its next write
        into the shared last block copies it first (copy-on-write, in ``schedule``).
      release: running requests to drop afterwards (blocks freed, no ``finished`` entry);
        typically the parents.
    """
    bm = state.block_manager.copy()
    requests = dict(state.requests)
    running = list(state.running)
    for i, (parent_id, child_id, token) in enumerate(forks):
        prs = requests.get(parent_id)
        if parent_id not in state.running or prs.num_computed_tokens != prs.num_tokens:
            raise ValueError(f"fork parent_id={parent_id!r} is not running with every token "
                             f"computed")
        if child_id in requests:
            raise ValueError(f"fork child_id={child_id!r} is already queued or running")
        _register(bm, prs, prs.num_computed_tokens)
        bm.fork(parent_id, child_id)
        requests[child_id] = RequestState(
            dataclasses.replace(prs.request, request_id=child_id, fork_of=None),
            state.num_added + i, prs.output_token_ids + (int(token),), prs.num_computed_tokens)
        _insert(running, child_id, requests, config.policy)
    for request_id in release:
        if request_id not in running:
            raise ValueError(f"release names request_id={request_id!r}, which is not running")
        _free(bm, requests.pop(request_id))
        running.remove(request_id)
    return dataclasses.replace(state, block_manager=bm, requests=types.MappingProxyType(requests),
                               running=tuple(running), num_added=state.num_added + len(forks))


def check_invariants(state: SchedulerState, config: SchedulerConfig) -> None:
    """Raise ``AssertionError`` unless ``state`` is consistent (block manager included).

    Checks: waiting and running partition the live requests; both are sorted by the policy key;
    exactly the running requests own block tables, each exactly ``cdiv(num_computed_tokens,
    block_size)`` blocks long, whose dropped (null) entries are all ones the retention policy
    allows to drop (no block a later query sees is gone); waiting requests have computed nothing; at
    most ``max_num_seqs`` run; running counters stay within ``[1, num_tokens + num_draft_tokens]``.
    """
    bm = state.block_manager
    bm.check_invariants()
    waiting, running = set(state.waiting), set(state.running)
    _check(len(waiting) == len(state.waiting), "duplicate id in waiting")
    _check(len(running) == len(state.running), "duplicate id in running")
    _check(not waiting & running, "a request is both waiting and running")
    _check(waiting | running == set(state.requests), "waiting + running != live requests")
    _check(set(bm.request_ids()) == running, "block tables != running requests")
    _check(len(running) <= config.max_num_seqs, "more than max_num_seqs running")
    _check(not set(state.finished) & set(state.requests), "a finished request is still live")
    for queue in (state.waiting, state.running):
        keys = [_key(state.requests[i], config.policy) for i in queue]
        _check(keys == sorted(keys), "queue not in policy order")
    for request_id in state.waiting:
        _check(state.requests[request_id].num_computed_tokens == 0
               and state.requests[request_id].num_draft_tokens == 0,
               f"waiting request {request_id!r} has computed tokens")
        swapped = state.host is not None and state.host.swapped(request_id) is not None
        _check(swapped == (state.requests[request_id].swapped_tokens > 0),
               f"waiting request {request_id!r}: swapped_tokens and the host tier disagree")
    if state.host is not None:
        state.host.check_invariants()
        _check(all(state.host.swapped(i) is None for i in state.running),
               "a running request still holds swapped host slots")
    for request_id in state.running:
        rs = state.requests[request_id]
        _check(1 <= rs.num_computed_tokens <= rs.num_tokens + rs.num_draft_tokens,
               f"request {request_id!r}: num_computed_tokens={rs.num_computed_tokens} "
               f"not in [1, num_tokens + num_draft_tokens = "
               f"{rs.num_tokens + rs.num_draft_tokens}]")
        table = bm.block_table(request_id)
        _check(len(table) == bm.blocks_for(rs.num_computed_tokens),
               f"request {request_id!r}: block table length != cdiv(num_computed_tokens, "
               f"block_size)")
        at = rs.num_computed_tokens - rs.num_draft_tokens
        dropped = [j for j, b in enumerate(table) if b == 0]
        _check(all(state.retention.may_drop(at, j, bm.block_size) for j in dropped),
               f"request {request_id!r}: dropped blocks {dropped} include one its policy keeps")


def _check(condition, message: str) -> None:
    """``assert`` that survives ``python -O``."""
    if not condition:
        raise AssertionError(message)
