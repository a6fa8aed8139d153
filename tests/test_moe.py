"""The mixture-of-experts layer (jaxkv/model/moe.py) against dense references: the grouped
matmul's CPU tile loop and Pallas kernel (interpret mode; compiled for an H100 in
tests/test_gpu_compile.py), the router's top-k, and the whole layer against a loop over every
expert."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.model import moe
from jaxkv.model.grouped_matmul import grouped_matmul, tile_schedule
from jaxkv.model.config import ModelConfig


def dense_grouped(rows, w, sizes):
    """The spec: row r goes to the group whose cumulative range holds it."""
    group = np.searchsorted(np.cumsum(sizes), np.arange(len(rows)), side="right")
    return np.stack([rows[r] @ w[g] if g < len(w) else np.zeros(w.shape[2], np.float32)
                     for r, g in enumerate(group)])


@pytest.mark.parametrize("impl", ["tiles", "pallas"])
@pytest.mark.parametrize("sizes", [
    [0, 21, 0, 0, 40, 3],           # empty groups, groups over two and three 16-row tiles
    [64, 0, 0, 0, 0, 0],            # one expert takes every row
    [1, 1, 1, 1, 1, 1],             # a decode step: rows spread thin
])
def test_grouped_matmul_equals_the_spec(sizes, impl):
    rng = np.random.default_rng(len(sizes) + sizes[0])
    rows = rng.standard_normal((sum(sizes), 32)).astype(np.float32)
    w = rng.standard_normal((6, 32, 48)).astype(np.float32)
    want = dense_grouped(rows, w, np.array(sizes))
    g = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(functools.partial(grouped_matmul, impl=impl, interpret=True))(rows, w, g)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_tile_schedule_covers_each_row_once_and_skips_empty_groups():
    sched, used = tile_schedule(jnp.asarray([0, 21, 0, 5], jnp.int32), 8, 16)
    assert int(used) == 3
    assert np.asarray(sched).tolist() == [[1, 0, 16], [1, 16, 5], [3, 21, 5]] + [[3, 0, 0]] * 5


@pytest.mark.parametrize("top_k,normalize", [(2, True), (3, False), (1, True)])
def test_experts_mlp_equals_a_loop_over_every_expert(top_k, normalize):
    """Each token's output is its top-k experts' SwiGLUs weighted by the (renormalised) softmax
    of the router: computed densely, every expert on every token, as the spec."""
    rng = np.random.default_rng(top_k)
    T, E, F, X = 13, 16, 24, 5
    x = rng.standard_normal((T, E)).astype(np.float32)
    logits = rng.standard_normal((T, X)).astype(np.float32)
    gate, up = (rng.standard_normal((X, E, F)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((X, F, E)).astype(np.float32) * 0.3
    weights, experts = moe.route(jnp.asarray(logits), top_k, normalize)
    out = jax.jit(moe.experts_mlp)(x, weights, experts, gate, up, down)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[:, :top_k]
    want = np.zeros((T, E), np.float32)
    for t in range(T):
        p = probs[t, chosen[t]]
        p = p / p.sum() if normalize else p
        for j, e in enumerate(chosen[t]):
            g = x[t] @ gate[e]
            want[t] += p[j] * ((g / (1 + np.exp(-g)) * (x[t] @ up[e])) @ down[e])
    assert (np.sort(np.asarray(experts), -1) == np.sort(chosen, -1)).all()
    np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-4)


def test_gpt_oss_experts_equal_a_loop_over_every_expert():
    """gpt-oss: the top-2 router logits softmaxed among themselves, biased experts, the clamped
    SwiGLU ``(clip(u) + 1) * min(g, 7) * sigmoid(1.702 * min(g, 7))``; inputs large enough
    that both clamps bite."""
    rng = np.random.default_rng(7)
    T, E, F, X, k, limit, alpha = 11, 16, 8, 5, 2, 7.0, 1.702
    x = rng.standard_normal((T, E)).astype(np.float32) * 3
    logits = rng.standard_normal((T, X)).astype(np.float32)
    gate, up = (rng.standard_normal((X, E, F)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((X, F, E)).astype(np.float32) * 0.3
    bg, bu, bd = (rng.standard_normal(s).astype(np.float32) for s in ((X, F), (X, F), (X, E)))
    weights, experts = moe.route(jnp.asarray(logits), k, False, topk_first=True)
    act = functools.partial(moe.clamped_swiglu, alpha=alpha, limit=limit)
    out = jax.jit(functools.partial(moe.experts_mlp, act=act))(
        x, weights, experts, gate, up, down, biases=(bg, bu, bd))
    want = np.zeros((T, E), np.float32)
    clamped = 0
    for t in range(T):
        chosen = np.argsort(-logits[t])[:k]
        p = np.exp(logits[t, chosen]) / np.exp(logits[t, chosen]).sum()
        for j, e in enumerate(chosen):
            g, u = x[t] @ gate[e] + bg[e], x[t] @ up[e] + bu[e]
            clamped += (g > limit).sum() + (np.abs(u) > limit).sum()
            g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            want[t] += p[j] * (((u + 1) * g / (1 + np.exp(-alpha * g))) @ down[e] + bd[e])
    assert clamped > 0
    np.testing.assert_allclose(out, want, atol=1e-4, rtol=1e-4)


def test_moe_configs_are_checked():
    base = dict(architecture="mixtral", vocab_size=64, hidden_size=32, intermediate_size=64,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in \[1, num_experts=4"):
        ModelConfig(**base, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="dense_layers=\\(2,\\) must be layer indices"):
        ModelConfig(**base, num_experts_per_tok=2, dense_layers=(2,))
    c = ModelConfig(**base, num_experts_per_tok=2, dense_layers=(1,))
    assert [c.is_moe_layer(i) for i in range(2)] == [True, False]
