"""The mixture-of-experts layer (jaxkv/model/moe.py) against dense references: the router's
top-k, the CPU tile loop and ``jax.lax.ragged_dot`` as grouped matmuls, and the whole layer
against a loop over every expert."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.model import moe
from jaxkv.model.config import ModelConfig


def dense_grouped(rows, w, sizes):
    """The spec: row r goes to the group whose cumulative range holds it."""
    group = np.searchsorted(np.cumsum(sizes), np.arange(len(rows)), side="right")
    return np.stack([rows[r] @ w[g] if g < len(w) else np.zeros(w.shape[2], np.float32)
                     for r, g in enumerate(group)])


@pytest.mark.parametrize("sizes", [
    [0, 5, 0, 0, 11, 3],            # empty groups, a group over two 8-row tiles
    [40, 0, 0, 0, 0, 0],            # one expert takes every row
    [1, 1, 1, 1, 1, 1],             # a decode step: rows spread thin
])
def test_grouped_matmul_tiles_and_ragged_dot_equal_the_spec(sizes):
    rng = np.random.default_rng(len(sizes) + sizes[0])
    rows = rng.standard_normal((sum(sizes), 16)).astype(np.float32)
    w = rng.standard_normal((6, 16, 24)).astype(np.float32)
    want = dense_grouped(rows, w, np.array(sizes))
    g = jnp.asarray(sizes, jnp.int32)
    tiled = jax.jit(moe._tiled_grouped_matmul)(rows, w, g)
    np.testing.assert_allclose(tiled, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(jax.lax.ragged_dot(rows, w, g), want, atol=1e-4, rtol=1e-4)


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


def test_moe_configs_are_checked():
    base = dict(architecture="mixtral", vocab_size=64, hidden_size=32, intermediate_size=64,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in \[1, num_experts=4"):
        ModelConfig(**base, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="dense_layers=\\(2,\\) must be layer indices"):
        ModelConfig(**base, num_experts_per_tok=2, dense_layers=(2,))
    c = ModelConfig(**base, num_experts_per_tok=2, dense_layers=(1,))
    assert [c.is_moe_layer(i) for i in range(2)] == [True, False]
