"""The draft-model proposer of speculative decoding (``speculative="draft"``): a small model with
the target's tokenizer, run by the engine's own device machinery over its own paged KV cache.

Design notes: docs/speculative-decoding.md."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxkv.blocks.block_manager import BlockManager, cdiv
from jaxkv.config import CacheArgs, EngineConfig, ModelArgs, SpeculativeArgs
from jaxkv.model import checkpoint
from jaxkv.model.llama import params_from_hf
from jaxkv.model.weights import load_config, load_model_files
from jaxkv.runner.model_runner import ModelRunner, RowInput
from jaxkv.sample.sampler import SamplingParams
from jaxkv.sched.plan import ScheduledSeq, StepPlan
from jaxkv.sched.step_cost import StepCostModel

_GREEDY = SamplingParams(temperature=0.0)


def default_num_blocks(target_num_blocks: int, max_num_seqs: int, max_model_len: int,
                       block_size: int, num_drafts: int) -> int:
    """The draft pool's size in blocks, null block included (see the module docstring)."""
    full = max_num_seqs * cdiv(max_model_len, block_size) + 1
    return min(full, target_num_blocks + max_num_seqs * (cdiv(num_drafts, block_size) + 1))


def draft_engine_config(config: EngineConfig, target: ModelRunner,
                        num_blocks: int | None = None) -> EngineConfig:
    """The engine config the draft's ``ModelRunner`` is built from: the target's (dtype, seed,
    block size, step limits and buckets with the target's resolved ``max_model_len``, parallel
    and runtime groups), the ``speculative_model``'s weights, a pool of ``num_blocks`` (default
    ``default_num_blocks``) in the draft's own dtype, no prefix caching, no speculation."""
    spec = config.speculative
    sc = target.sched_config
    if num_blocks is None:
        num_blocks = default_num_blocks(target.cache_config.num_blocks, sc.max_num_seqs,
                                        sc.max_model_len, target.cache_config.block_size,
                                        spec.num_speculative_tokens)
    return dataclasses.replace(
        config, model=ModelArgs(model=spec.speculative_model, dtype=config.model.dtype,
                                seed=config.model.seed),
        cache=CacheArgs(block_size=target.cache_config.block_size,
                        gpu_memory_utilization=config.cache.gpu_memory_utilization,
                        num_gpu_blocks_override=num_blocks, prefix_caching=None),
        scheduler=sc, speculative=SpeculativeArgs())


def write_truncated_draft(model: str, path: str, layers: int | Sequence[int], *,
                          dtype: str = "float32", overwrite: bool = False) -> Path:
    """Writes a draft for ``model`` made of some of its decoder layers (with its embedding,
    final norm and LM head) as an orbax checkpoint (``jaxkv convert``'s format, with the same
    tokenizer), loadable as ``speculative_model=path``.

    Args:
      model: GGUF file, HF directory or store name (read by the engine's loader).
      path: the checkpoint directory.
      layers: the decoder layers kept, in order: an int ``N`` for the first ``N``, or their
        indices (e.g. the first and last 12 of SmolLM2's 30: a middle block skipped, as in
        self-speculative decoding).

    Returns:
      The checkpoint directory.
    """
    loaded = load_model_files(model)
    n = loaded.config.num_layers
    keep = list(range(layers)) if isinstance(layers, int) else [int(i) for i in layers]
    if not keep or any(not 0 <= i < n for i in keep) or len(set(keep)) != len(keep):
        raise ValueError(f"layers={layers!r} must name 1 to {n} distinct layers in [0, {n})")
    new_index = {f"model.layers.{old}.": f"model.layers.{new}." for new, old in enumerate(keep)}
    tensors = {}
    for name, value in loaded.tensors.items():
        if not name.startswith("model.layers."):
            tensors[name] = value
            continue
        prefix = ".".join(name.split(".")[:3]) + "."
        if prefix in new_index:
            tensors[new_index[prefix] + name[len(prefix):]] = value
    config = dataclasses.replace(loaded.config, num_layers=len(keep))
    params = params_from_hf(config, tensors, jnp.dtype(dtype), source=loaded.source)
    checkpoint.save_params(path, params, {"source": loaded.source, "dtype": dtype,
                                          "layers": keep}, config=config, overwrite=overwrite)
    checkpoint.write_tokenizer(path, loaded.tokenizer)
    return Path(path)


def write_reduced_head_draft(draft: str, path: str, token_ids: Sequence[int], *,
                             overwrite: bool = False) -> Path:
    """Writes ``draft`` with an LM head over ``token_ids`` only (the module docstring: the
    head's columns for those tokens, untied; the input embedding, trunk and tokenizer as they
    are), loadable as ``speculative_model=path``.

    Args:
      draft: a draft checkpoint (``write_truncated_draft``'s, bench/train_draft.py's), GGUF
        file, HF directory or store name.
      path: the checkpoint directory.
      token_ids: the tokens the head scores (distinct, in ``[0, vocab_size)``; order = column).

    Returns:
      The checkpoint directory.

    Raises:
      ValueError: naming ``token_ids`` (empty, repeated or out of range).
    """
    if checkpoint.is_checkpoint(draft):
        config, params = checkpoint.read_config(draft), checkpoint.restore_params(draft)
        metadata, tokenizer = checkpoint.read_metadata(draft), checkpoint.read_tokenizer(draft)
    else:
        loaded = load_model_files(draft)
        config, metadata, tokenizer = loaded.config, {"source": loaded.source}, loaded.tokenizer
        params = params_from_hf(config, loaded.tensors, jnp.float32, source=loaded.source)
    ids = np.asarray(token_ids, np.int64)
    if (ids.ndim != 1 or not ids.size or len(np.unique(ids)) != ids.size
            or ids.min() < 0 or ids.max() >= config.vocab_size):
        raise ValueError(f"token_ids must be 1 to {config.vocab_size} distinct ids in "
                         f"[0, {config.vocab_size}); got {ids.size} (min {ids.min(initial=0)}, "
                         f"max {ids.max(initial=0)})")
    full_head = (np.asarray(params["embed_tokens"]).T if config.tie_word_embeddings
                 else np.asarray(params["lm_head"]))                  # [E, vocab_size]
    params = {**params, "lm_head": full_head[:, ids]}                 # [E, len(ids)]
    config = dataclasses.replace(config, tie_word_embeddings=False, draft_vocab_size=ids.size)
    checkpoint.save_params(path, params, {**metadata, "head_token_ids": ids.tolist()},
                           config=config, overwrite=overwrite)
    checkpoint.write_tokenizer(path, tokenizer)
    return Path(path)


def _read_config(model: str):
    return checkpoint.read_config(model) if checkpoint.is_checkpoint(model) else load_config(model)


class DraftModelProposer:
    """Greedy drafts from a small model run over its own paged KV cache (see the module
    docstring).

    Args:
      runner: the draft's ``ModelRunner`` (its config's scheduler group bounds a draft step:
        ``max_num_seqs`` sequences, ``max_num_batched_tokens`` tokens).
      head_token_ids: int [num_logits], the token id of each of the draft's logit columns when
        its LM head is reduced (``write_reduced_head_draft``), else None.

    Attributes:
      runner: as given.
      block_manager: the draft pool's owner (tables exist exactly for the requests with
        draft state).
      probe_interval: the adaptive draft length asks for a request it gives no drafts (k = 0)
        once per this many steps only, more rarely after probes that miss
        (``Speculator.drafts``): every proposal costs a draft forward.
      forward_cost: the wall time of the draft's forwards (its batch built on the host, the
        device step, its tokens back) by padded shape (a ``StepCostModel`` over the draft's
        buckets): the adaptive draft length's cost of proposing (``Speculator.proposal_time``).
        Wall time, not device time: all of a draft forward is on the step's critical path.
    """

    probe_interval = 8

    def __init__(self, runner: ModelRunner, head_token_ids: Sequence[int] | None = None):
        self.runner = runner
        self._head_token_ids = (None if head_token_ids is None
                                else np.asarray(head_token_ids, np.int64))
        cc = runner.cache_config
        self.block_manager = BlockManager(cc.num_blocks, cc.block_size)
        self._cached: dict[Hashable, np.ndarray] = {}   # int32 [n]: tokens whose K/V is cached
        self._num_steps = 0   # draft forwards (catch-up chunks and decodes)
        self.forward_cost = StepCostModel.for_scheduler(runner.sched_config)

    @classmethod
    def from_config(cls, config: EngineConfig, target: ModelRunner,
                    num_blocks: int | None = None) -> DraftModelProposer:
        """The proposer of an engine config with ``speculative="draft"``, for the engine's
        ``target`` runner; compiles the draft's step buckets when ``config.runtime.warmup``.

        Raises:
          ValueError: naming ``speculative_model``: it is not given, or its vocabulary (size, or
            tokenizer) differs from the target's. The vocabulary size is checked before the
            draft's weights load.
        """
        model = config.speculative.speculative_model
        if not model:
            raise ValueError('speculative="draft" needs speculative_model (the draft model)')
        vocab = _read_config(model).vocab_size
        if vocab != target.model_config.vocab_size:
            raise ValueError(f"speculative_model={model!r}: its vocab_size={vocab} differs from "
                             f"the target model's {target.model_config.vocab_size}")
        runner = ModelRunner(draft_engine_config(config, target, num_blocks))
        if (runner.tokenizer.backend.get_vocab(with_added_tokens=True)
                != target.tokenizer.backend.get_vocab(with_added_tokens=True)):
            runner.close()
            raise ValueError(f"speculative_model={model!r}: its tokenizer's vocabulary differs "
                             f"from the target model's")
        head = (checkpoint.read_metadata(model).get("head_token_ids")
                if checkpoint.is_checkpoint(model) else None)
        proposer = cls(runner, head)
        if config.runtime.warmup:
            runner.warmup()
            proposer.forward_cost.compiled()
        return proposer

    def propose_batch(self, requests: Mapping[Hashable, tuple[np.ndarray, int]]
                      ) -> dict[Hashable, tuple[int, ...]]:
        """Greedy drafts for several requests at once.

        Args:
          requests: ``{request_id: (token_ids, k)}``: int32 [L] prompt + output so far (L >= 1),
            and the drafts wanted (k >= 1); most urgent first (the order blocks are given in).

        Returns:
          ``{request_id: k draft tokens}``, for the requests whose draft K/V fits in the pool
          (the others get none and lose their draft state). ``k`` is cut so that the drafts
          stay within ``max_model_len``.
        """
        max_len = self.runner.sched_config.max_model_len
        bm = self.block_manager
        jobs: dict[Hashable, tuple[np.ndarray, int, int]] = {}   # id -> (tokens, keep, k)
        for request_id, (token_ids, k) in requests.items():
            tokens = np.asarray(token_ids, np.int32)
            length = len(tokens)
            k = min(k, max_len - length + 1)
            if k < 1 or length < 1:
                continue
            cached = self._cached.get(request_id, tokens[:0])
            m = min(len(cached), length - 1)
            diff = np.flatnonzero(cached[:m] != tokens[:m])
            keep = int(diff[0]) if diff.size else m
            if not self._fit(request_id, keep, length + k - 1):
                continue
            jobs[request_id] = (tokens, keep, k)
        drafts: dict[Hashable, list[int]] = {i: [] for i in jobs}
        for step in self._catch_up_steps(jobs):   # the first draft from each request's last token
            for request_id, token in self._run(step).items():
                drafts[request_id].append(token)
        for j in range(1, max((k for _, _, k in jobs.values()), default=1)):
            step = [ScheduledSeq(i, (drafts[i][-1],), len(t) - 1 + j, True, bm.block_table(i))
                    for i, (t, _, k) in jobs.items() if k > j]
            for start in range(0, len(step), self.runner.sched_config.max_num_seqs):
                for request_id, token in self._run(
                        step[start:start + self.runner.sched_config.max_num_seqs]).items():
                    drafts[request_id].append(token)
        for request_id, (tokens, _, k) in jobs.items():
            self._cached[request_id] = np.concatenate(
                [tokens, np.asarray(drafts[request_id][:k - 1], np.int32)])
        return {i: tuple(d) for i, d in drafts.items()}

    def _fit(self, request_id: Hashable, keep: int, total: int) -> bool:
        """Sizes ``request_id``'s table to hold ``total`` tokens of which the first ``keep`` are
        cached (dropping the blocks past them first); False (and its state released) when the
        free blocks do not suffice."""
        bm = self.block_manager
        if request_id in bm:
            if keep >= 1:
                bm.truncate(request_id, keep)
            else:
                bm.free(request_id)
        if request_id in bm:
            if bm.can_append_slots(request_id, total):
                bm.append_slots(request_id, total)
                return True
        elif bm.can_allocate(total):
            bm.allocate(request_id, total)
            return True
        self.release(request_id)
        return False

    def _catch_up_steps(self, jobs: Mapping[Hashable, tuple[np.ndarray, int, int]]
                        ) -> list[list[ScheduledSeq]]:
        """The catch-up forwards: every request's tokens ``[keep, L)`` packed, in order, into
        steps of at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences; a
        request's last chunk samples (its first draft)."""
        sc, bm = self.runner.sched_config, self.block_manager
        steps: list[list[ScheduledSeq]] = [[]]
        budget = sc.max_num_batched_tokens
        for request_id, (tokens, keep, _) in jobs.items():
            pos = keep
            while pos < len(tokens):
                if budget == 0 or len(steps[-1]) == sc.max_num_seqs:
                    steps.append([])
                    budget = sc.max_num_batched_tokens
                n = min(len(tokens) - pos, budget)
                steps[-1].append(ScheduledSeq(request_id, tuple(tokens[pos:pos + n].tolist()),
                                              pos, pos + n == len(tokens),
                                              bm.block_table(request_id)))
                pos += n
                budget -= n
        return [s for s in steps if s]

    def _run(self, seqs: Sequence[ScheduledSeq]) -> dict[Hashable, int]:
        """One draft forward of ``seqs``; the greedy token of each sampling sequence."""
        start = time.perf_counter()
        out = self.runner.execute(StepPlan(tuple(seqs)), [RowInput(_GREEDY, (), ())] * len(seqs))
        self._num_steps += 1
        tokens = out.tokens[:len(seqs), 0]
        if self._head_token_ids is not None:   # the reduced head's columns -> token ids
            tokens = self._head_token_ids[tokens]
        self.forward_cost.observe(sum(len(s.token_ids) for s in seqs), len(seqs), False,
                                  time.perf_counter() - start)
        return {s.request_id: int(tokens[row]) for row, s in enumerate(seqs) if s.sample}

    def release(self, request_id: Hashable) -> None:
        """Frees ``request_id``'s draft blocks and state (a no-op for an unknown id)."""
        self._cached.pop(request_id, None)
        if request_id in self.block_manager:
            self.block_manager.free(request_id)

    def stats(self) -> dict:
        """``spec_draft_num_steps`` (draft forwards), ``spec_draft_device_time_s`` (their
        device time), ``spec_draft_blocks_used`` (draft pool blocks held)."""
        bm = self.block_manager
        return {"spec_draft_num_steps": self._num_steps,
                "spec_draft_device_time_s": self.runner.device_time,
                "spec_draft_blocks_used": bm.num_blocks - 1 - bm.num_free_blocks}

    def close(self) -> None:
        """Frees the draft's device memory."""
        self.runner.close()
