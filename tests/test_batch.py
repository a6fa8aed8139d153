"""batch.build: the exact padded device arrays, bucket choice, errors; SchedulerConfig buckets."""

import numpy as np
import pytest

from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.runner import batch
from jaxkv.sched.plan import ScheduledSeq as S, StepPlan
from jaxkv.sched.scheduler import add_request, schedule, update
from jaxkv.sched.state import Request, StopSpec, init_state

CC = CacheConfig(block_size=4, num_blocks=10)
SC = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=16,
                     token_buckets=(8, 16), seq_buckets=(4, 8))


def test_docstring_example_exactly():
    plan = StepPlan((S("A", (11, 12, 13, 14, 15), 0, True, (7, 2)),
                     S("B", (21,), 9, True, (4, 9, 1))))
    x = batch.build(plan, CC, SC)
    assert (x.num_tokens, x.num_seqs) == (6, 2)
    np.testing.assert_array_equal(x.token_ids, [11, 12, 13, 14, 15, 21, 0, 0])
    np.testing.assert_array_equal(x.positions, [0, 1, 2, 3, 4, 9, 0, 0])
    np.testing.assert_array_equal(x.slot_mapping, [28, 29, 30, 31, 8, 5, 0, 0])
    np.testing.assert_array_equal(x.query_start_loc, [0, 5, 6, 6, 6])
    np.testing.assert_array_equal(x.seq_lens, [5, 10, 0, 0])
    np.testing.assert_array_equal(x.block_tables, [[7, 2, 0, 0], [4, 9, 1, 0],
                                                   [0, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(x.logits_indices, [[4], [5], [0], [0]])
    np.testing.assert_array_equal(x.sample_mask, [True, True, False, False])
    np.testing.assert_array_equal(x.num_drafts, [0, 0, 0, 0])
    for name in ("token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                 "block_tables", "logits_indices", "num_drafts"):
        assert getattr(x, name).dtype == np.int32, name
    assert x.sample_mask.dtype == np.bool_


def test_draft_rows_docstring_example():
    plan = StepPlan((S("A", (11, 12, 13, 14, 15), 0, True, (7, 2)),
                     S("B", (21, 77, 78), 9, True, (4, 9, 1), num_drafts=2)))
    x = batch.build(plan, CC, SC, max_drafts=3)
    np.testing.assert_array_equal(x.token_ids, [11, 12, 13, 14, 15, 21, 77, 78])
    np.testing.assert_array_equal(x.positions[5:], [9, 10, 11])
    np.testing.assert_array_equal(x.slot_mapping[5:], [5, 6, 7])
    np.testing.assert_array_equal(x.seq_lens, [5, 12, 0, 0])
    np.testing.assert_array_equal(x.logits_indices, [[4, 0, 0, 0], [5, 6, 7, 0],
                                                     [0, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(x.num_drafts, [0, 2, 0, 0])
    assert x.logits_indices.dtype == x.num_drafts.dtype == np.int32
    # without drafts the width stays 1, whatever max_drafts
    x = batch.build(StepPlan(plan.seqs[:1]), CC, SC, max_drafts=3)
    assert x.logits_indices.shape == (4, 1)
    for seq, max_drafts in [(plan.seqs[1], 1),
                            (S("B", (21, 77), 9, False, (4, 9, 1), num_drafts=1), 3),
                            (S("B", (77,), 9, True, (4, 9, 1), num_drafts=1), 3)]:
        with pytest.raises(ValueError, match="num_drafts="):
            batch.build(StepPlan((seq,)), CC, SC, max_drafts=max_drafts)


def test_non_sampling_chunk_and_bucket_growth():
    # 9 tokens -> T bucket 16; 5 seqs -> S bucket 8; a mid-prompt chunk does not sample
    seqs = [S("p", (1, 2, 3, 4, 5), 3, False, (6, 3))]
    seqs += [S(f"d{i}", (40 + i,), 4 + i, True, (8 - i, 5 - i)) for i in range(4)]
    x = batch.build(StepPlan(tuple(seqs)), CC, SC)
    assert x.token_ids.shape == x.positions.shape == x.slot_mapping.shape == (16,)
    assert x.block_tables.shape == (8, 4) and x.query_start_loc.shape == (9,)
    np.testing.assert_array_equal(x.positions[:9], [3, 4, 5, 6, 7, 4, 5, 6, 7])
    np.testing.assert_array_equal(
        x.slot_mapping[:9], [6 * 4 + 3, 3 * 4, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3,
                             5 * 4, 4 * 4 + 1, 3 * 4 + 2, 2 * 4 + 3])
    np.testing.assert_array_equal(x.slot_mapping[9:], 0)
    np.testing.assert_array_equal(x.query_start_loc, [0, 5, 6, 7, 8, 9, 9, 9, 9])
    np.testing.assert_array_equal(x.seq_lens, [8, 5, 6, 7, 8, 0, 0, 0])
    np.testing.assert_array_equal(x.logits_indices[:, 0], [0, 5, 6, 7, 8, 0, 0, 0])
    np.testing.assert_array_equal(x.sample_mask, [False, True, True, True, True] + [False] * 3)


def test_dropped_blocks_before_the_written_positions_are_allowed():
    # a retention policy dropped logical block 1 (positions 4..7); position 8 is written in 4
    x = batch.build(StepPlan((S("a", (9,), 8, True, (3, 0, 4)),)), CC, SC)
    np.testing.assert_array_equal(x.block_tables[0, :3], [3, 0, 4])
    assert x.slot_mapping[0] == 4 * 4 + 0 and x.positions[0] == 8


def test_exact_bucket_fit_and_empty_plan():
    x = batch.build(StepPlan((S("a", tuple(range(8)), 0, True, (3, 1)),)), CC, SC)
    assert x.token_ids.shape == (8,) and x.seq_lens.shape == (4,)
    empty = batch.build(StepPlan(()), CC, SC)
    assert (empty.num_tokens, empty.num_seqs) == (0, 0)
    np.testing.assert_array_equal(empty.query_start_loc, [0, 0, 0, 0, 0])
    assert not empty.sample_mask.any() and not empty.block_tables.any()


@pytest.mark.parametrize("seq, match", [
    (S("a", (1, 2, 3, 4, 5), 0, True, (3,)), "block_table has 1 blocks; positions < 5 need 2"),
    (S("a", (1,), 0, True, (3, 4, 5, 6, 7)), "max_blocks_per_seq=4"),
    (S("a", (1,), 0, True, (0,)), "null block where positions \\[0, 1\\) are written"),
    (S("a", (9,), 8, True, (3, 4, 0)), "null block where positions \\[8, 9\\) are written"),
    (S("a", (1,), 0, True, (10,)), "outside \\[0, num_blocks=10\\)"),
    (S("a", (1,), 0, True, (-1,)), "outside \\[0, num_blocks=10\\)"),
    (S("a", (), 0, True, (1,)), "token_ids must be non-empty"),
    (S("a", tuple(range(17)), 0, True, (1, 2, 3, 4, 5)), "num_tokens=17, more than token_buckets"),
])
def test_bad_plans_raise(seq, match):
    with pytest.raises(ValueError, match=match):
        batch.build(StepPlan((seq,)), CC, SC)


def test_too_many_seqs_raise():
    plan = StepPlan(tuple(S(i, (1,), 0, True, (1,)) for i in range(9)))
    with pytest.raises(ValueError, match="num_seqs=9, more than seq_buckets\\[-1\\]=8"):
        batch.build(plan, CC, SC)


def test_scheduler_plan_round_trip():
    cc = CacheConfig(block_size=2, num_blocks=12)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=12)
    state = init_state(cc)
    for rid, prompt in (("a", (5, 6, 7, 8)), ("b", (9, 10, 11, 12, 13, 14, 15))):
        state = add_request(state, Request(request_id=rid, prompt_token_ids=prompt,
                                           stop=StopSpec(max_tokens=4)), sc)
    state, plan = schedule(state, sc)
    state = update(state, plan, [50, 0])
    state, plan = schedule(state, sc)  # a decodes into a new block, b's chunk spans two
    assert [s.block_table for s in plan.seqs] == [(1, 2, 5), (3, 4, 6, 7)]
    x = batch.build(plan, cc, sc)
    assert batch.max_blocks_per_seq(cc, sc) == 6 and x.block_tables.shape == (4, 6)
    np.testing.assert_array_equal(x.token_ids[:4], [50, 13, 14, 15])
    np.testing.assert_array_equal(x.positions[:4], [4, 4, 5, 6])
    np.testing.assert_array_equal(x.slot_mapping[:4], [5 * 2, 6 * 2, 6 * 2 + 1, 7 * 2])
    np.testing.assert_array_equal(x.seq_lens, [5, 7, 0, 0])
    np.testing.assert_array_equal(x.logits_indices, [[0], [3], [0], [0]])


def test_decode_buckets_pad_a_decode_only_step_on_both_axes():
    sc = SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024)
    assert sc.decode_buckets == (1, 2, 4, 20, 24, 28, 80, 96, 112, 160, 192, 224)
    pairs, decode = sc.step_shapes()
    assert len(pairs) == 42 and decode == [(1, 1), (2, 2), (4, 4), (20, 20), (24, 24), (28, 28),
                                           (80, 80), (112, 112), (160, 160), (192, 192),
                                           (224, 224)]
    # a decode-only step: its decode bucket where one is below the token bucket
    assert [sc.padded_shape(n, n) for n in (1, 2, 3, 5, 7, 16, 17, 23, 29, 33, 64, 65, 81, 100,
                                            113, 200)] \
        == [(1, 1), (2, 2), (4, 4), (8, 8), (8, 8), (16, 16), (20, 20), (24, 24), (32, 32),
            (64, 64), (64, 64), (80, 80), (96, 96), (112, 112), (128, 128), (224, 224)]
    # any step with more tokens than sequences (a prefill chunk, drafts): the bucket pair
    assert sc.padded_shape(101, 100) == (128, 128) and sc.padded_shape(512, 70) == (512, 96)
    # every shape a step can pad to is compiled by the warm-up
    small = SchedulerConfig(max_num_seqs=20, max_num_batched_tokens=48, max_model_len=64,
                            token_buckets=(8, 16, 48), seq_buckets=(4, 8, 20),
                            decode_buckets=(6, 12, 14))
    pairs, decode = small.step_shapes()
    assert pairs == [(8, 4), (8, 8), (16, 4), (16, 8), (16, 20), (48, 4), (48, 8), (48, 20)]
    assert decode == [(6, 4), (6, 6), (12, 12), (14, 14)]
    assert {small.padded_shape(t, n) for t in range(1, 49) for n in range(1, min(t, 20) + 1)} \
        == set(pairs) | set(decode)
    # the defaults go with the default buckets only, and end below the smaller maximum
    assert SchedulerConfig(max_model_len=8, token_buckets=(2048,)).decode_buckets == ()
    assert SchedulerConfig(max_num_seqs=100, max_model_len=8).decode_buckets == (1, 2, 4, 20,
                                                                                  24, 28, 80,
                                                                                  96)
    assert SchedulerConfig(max_num_seqs=64, max_model_len=8).decode_buckets == (1, 2, 4, 20, 24,
                                                                                 28)
    assert SchedulerConfig(max_num_seqs=22, max_model_len=8).decode_buckets == (1, 2, 4, 20)
    assert SchedulerConfig(max_num_seqs=2, max_model_len=8).decode_buckets == (1, 2)
    # batch.build lays a decode step of 41 out on 48 rows
    sc = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64, max_model_len=16,
                         token_buckets=(16, 64), seq_buckets=(16, 64), decode_buckets=(48,))
    plan = StepPlan(tuple(S(f"r{i}", (100 + i,), 5, True, (1 + i % 9, 2 + i % 7))
                          for i in range(41)))
    x = batch.build(plan, CacheConfig(block_size=4, num_blocks=10), sc)
    assert x.token_ids.shape == (48,) and x.seq_lens.shape == (48,)
    np.testing.assert_array_equal(x.token_ids, [*range(100, 141), *[0] * 7])
    np.testing.assert_array_equal(x.query_start_loc, [*range(42), *[41] * 7])
    np.testing.assert_array_equal(x.logits_indices[:, 0], [*range(41), *[0] * 7])
    np.testing.assert_array_equal(x.slot_mapping[:41], [(2 + i % 7) * 4 + 1 for i in range(41)])
    x = batch.build(StepPlan(plan.seqs[:40] + (S("p", (1, 2), 0, True, (3,)),)),
                    CacheConfig(block_size=4, num_blocks=10), sc)
    assert x.token_ids.shape == (64,) and x.seq_lens.shape == (64,)
    for bad, match in [((48, 40), "decode_buckets=.* strictly increasing"),
                       ((0, 48), "decode_buckets=.* positive")]:
        with pytest.raises(ValueError, match=match):
            SchedulerConfig(max_model_len=64, decode_buckets=bad)


def test_default_buckets_and_validation():
    sc = SchedulerConfig(max_model_len=4096)
    assert sc.token_buckets == (8, 16, 32, 64, 96, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    assert sc.seq_buckets == (8, 16, 32, 64, 96, 128, 256)
    sc = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=100, max_model_len=64)
    assert sc.token_buckets == (8, 16, 32, 64, 96, 100) and sc.seq_buckets == (3,)
    # 96 only strictly inside the range: not past the maximum, not twice where it closes it
    assert SchedulerConfig(max_num_seqs=96, max_model_len=8).seq_buckets == (8, 16, 32, 64, 96)
    assert SchedulerConfig(max_num_seqs=80, max_model_len=8).seq_buckets == (8, 16, 32, 64, 80)
    assert SchedulerConfig(max_num_batched_tokens=4, max_model_len=8).token_buckets == (4,)
    # a midpoint only below the maximum, which closes the tuple
    assert SchedulerConfig(max_num_batched_tokens=512, max_model_len=8).token_buckets == (
        8, 16, 32, 64, 96, 128, 256, 384, 512)
    assert SchedulerConfig(max_num_batched_tokens=300, max_model_len=8).token_buckets == (
        8, 16, 32, 64, 96, 128, 256, 300)
    assert SchedulerConfig(max_model_len=8, seq_buckets=[8, 256]).seq_buckets == (8, 256)
    for kwargs, match in [
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0"),
        (dict(max_model_len=0), "max_model_len=0"),
        (dict(policy="lifo"), "policy='lifo'"),
        (dict(token_buckets=(16, 16, 2048)), "token_buckets=.* strictly increasing"),
        (dict(token_buckets=(0, 2048)), "token_buckets=.* positive"),
        (dict(token_buckets=(16, 1024)), "token_buckets\\[-1\\]=1024 must be >= max_num_batched"),
        (dict(seq_buckets=()), "seq_buckets must not be empty"),
        (dict(seq_buckets=(8, 128)), "seq_buckets\\[-1\\]=128 must be >= max_num_seqs=256"),
    ]:
        with pytest.raises(ValueError, match=match):
            SchedulerConfig(**{"max_model_len": 64, **kwargs})
