"""ps.optim against optax, float64 (``jax_enable_x64``): the schedules over their whole range,
and SGD, Adam, AdamW with masks (a prefix tree, a function) and chain(clip_by_global_norm,
adamw(schedule)) over five steps on a nested tree, updates and states compared step by step.
Skipped without jax and optax."""

from __future__ import annotations

from typing import Any

import numpy as np
import optree
import pytest
import torch

from pshard import optim

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

f64 = torch.float64
SHAPES = {"emb": (6, 4), "layers": [{"w": (4, 4), "b": (4,)}, {"w": (4, 2), "b": (2,)}]}


def _is_shape(s: Any) -> bool:
    return isinstance(s, tuple) and all(isinstance(i, int) for i in s)


def _tree(seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    return optree.tree_map(
        lambda s: torch.randn(s, dtype=f64, generator=g) * 3, SHAPES, is_leaf=_is_shape
    )


def _jax(tree: Any) -> Any:
    return optree.tree_map(lambda t: jnp.asarray(t.numpy()), tree)


def _close(ours: Any, theirs: Any, rtol: float = 1e-13) -> None:
    a = [t.numpy() for t in optree.tree_leaves(ours)]
    b = [np.asarray(x) for x in jax.tree.leaves(theirs)]
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype == np.float64
        np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-15)


SCHEDULES = {
    "linear": lambda m: m.linear_schedule(0.5, 0.01, transition_steps=7),
    "linear begin": lambda m: m.linear_schedule(0.0, 2.0, transition_steps=4, transition_begin=3),
    "linear constant": lambda m: m.linear_schedule(0.3, 1.0, transition_steps=0),
    "cosine": lambda m: m.cosine_decay_schedule(1.5, decay_steps=9, alpha=0.1, exponent=2.0),
    "warmup cosine": lambda m: m.warmup_cosine_decay_schedule(0.0, 1e-3, 3, 11, end_value=1e-5),
    "warmup cosine exponent": lambda m: m.warmup_cosine_decay_schedule(
        0.2, 0.9, warmup_steps=0, decay_steps=5, exponent=0.5
    ),
    "warmup cosine zero peak": lambda m: m.warmup_cosine_decay_schedule(0.1, 0.0, 2, 6, 0.5),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedules_equal_optax(name: str) -> None:
    ours, theirs = SCHEDULES[name](optim), SCHEDULES[name](optax)
    for count in range(16):
        value = ours(count)
        assert type(value) is float
        np.testing.assert_allclose(value, float(theirs(count)), rtol=1e-15, atol=1e-18)


def _schedule(m: Any, name: str, *args: Any) -> Any:
    """``m.<name>(*args)``; optax's called with a Python int: its state's count is an int32
    array, which JAX turns into float32 inside the schedule's arithmetic (relative 1e-8)."""
    s = getattr(m, name)(*args)
    return s if m is optim else lambda count: s(int(count))


def _matrices(params: Any) -> Any:
    """A mask from the structure: embeddings and weights decay, biases do not."""
    return {"emb": True, "layers": [{"w": True, "b": False} for _ in params["layers"]]}


TRANSFORMS = {
    "sgd": lambda m: m.sgd(0.1),
    "momentum": lambda m: m.sgd(0.1, momentum=0.9),
    "nesterov": lambda m: m.sgd(
        _schedule(m, "linear_schedule", 0.2, 0.05, 4), momentum=0.7, nesterov=True
    ),
    "adam": lambda m: m.adam(0.03, b1=0.8, b2=0.99, eps=1e-6),
    "adamw prefix mask": lambda m: m.adamw(
        0.03, weight_decay=0.2, mask={"emb": False, "layers": [True, {"w": True, "b": False}]}
    ),
    "adamw mask function": lambda m: m.adamw(0.03, weight_decay=0.2, mask=_matrices),
    "clip then adamw": lambda m: m.chain(
        m.clip_by_global_norm(20.7),  # clips the steps of seeds 3 and 4
        m.adamw(_schedule(m, "warmup_cosine_decay_schedule", 0.0, 0.05, 2, 8), weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transforms_equal_optax(name: str) -> None:
    ours, theirs = TRANSFORMS[name](optim), TRANSFORMS[name](optax)
    params, jparams = _tree(0), _jax(_tree(0))
    state, jstate = ours.init(params), theirs.init(jparams)
    clipped = 0
    for seed in range(1, 6):
        grads = _tree(seed)
        clipped += float(optim.global_norm(grads)) > 20.7
        updates, state = ours.update(grads, state, params)
        jupdates, jstate = theirs.update(_jax(grads), jstate, jparams)
        _close(updates, jupdates)
        params = optim.apply_updates(params, updates)
        jparams = optax.apply_updates(jparams, jupdates)
        _close(params, jparams)
    assert clipped == 2
    if "adam" in name:
        adam = state if isinstance(state, optim.ScaleByAdamState) else state[1]
        jadam = next(s for s in jax.tree.leaves(jstate, is_leaf=_is_adam) if _is_adam(s))
        assert adam.count == int(jadam.count) == 5
        _close(adam.mu, jadam.mu)
        _close(adam.nu, jadam.nu)


def _is_adam(s: Any) -> bool:
    return isinstance(s, optax.ScaleByAdamState)


def test_global_norm_equals_optax() -> None:
    grads = _tree(3)
    np.testing.assert_allclose(
        float(optim.global_norm(grads)), float(optax.tree.norm(_jax(grads))), rtol=1e-15
    )
