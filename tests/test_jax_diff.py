"""Differential tests against JAX and optax: the same programs, in float64, on 4 ranks (pshard
over gloo) and 4 CPU devices (JAX). Collectives inside ``shard_map`` with their VJPs and JVPs,
``shard_map`` gradients on a 1-D and a 2-D mesh, ``vmap`` and ``hessian`` through it, and
microbatching (sum, mean, concat) against ``optax.microbatch``, with gradients both ways.

JAX's ``check_vma=False`` is the convention pshard follows (a replicated output's cotangent is
shared equally over the mapped axes), so the two must agree to rounding."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import pshard as ps

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy
lax = jax.lax
JP = jax.sharding.PartitionSpec

TOL = {"rtol": 1e-12, "atol": 1e-12}
PERM = [(i, (i + 1) % 4) for i in range(4)]

pytestmark = [
    pytest.mark.skipif(len(jax.devices()) < 4, reason="JAX needs 4 CPU devices (XLA_FLAGS)"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
]


# --------------------------------------------------------------------------- the programs
# name -> (pshard body, JAX body, in spec, out spec, input shape); specs as P(...) entries


def _t_psum(x):
    return ps.psum(torch.sin(x), "x") * x


def _j_psum(x):
    return lax.psum(jnp.sin(x), "x") * x


def _t_gather(x):
    return ps.all_gather(x**2, "x", dim=0, tiled=True) * 2.0


def _j_gather(x):
    return lax.all_gather(x**2, "x", axis=0, tiled=True) * 2.0


def _t_scatter(x):
    return ps.psum_scatter(torch.cos(x) * 3.0, "x", dim=0, tiled=True)


def _j_scatter(x):
    return lax.psum_scatter(jnp.cos(x) * 3.0, "x", scatter_dimension=0, tiled=True)


def _t_a2a(x):
    return ps.all_to_all(x * x, "x", split_dim=0, concat_dim=1)


def _j_a2a(x):
    return lax.all_to_all(x * x, "x", split_axis=0, concat_axis=1, tiled=True)


def _t_ppermute(x):
    return ps.ppermute(torch.tanh(x), "x", PERM) + x


def _j_ppermute(x):
    return lax.ppermute(jnp.tanh(x), "x", PERM) + x


def _t_pmax(x):
    return ps.pmax(x, "x") * x


def _j_pmax(x):  # lax.pmax has no differentiation rule: the same maximum, differentiable
    return jnp.max(lax.all_gather(x, "x"), axis=0) * x


def _t_index(x):
    return x * (ps.axis_index("x") + 1.0)


def _j_index(x):
    return x * (lax.axis_index("x") + 1.0)


def _t_pmean_replicated(x):
    return ps.pmean((x**2).sum(), "x")


def _j_pmean_replicated(x):
    return lax.pmean((x**2).sum(), "x")


CASES = {
    "psum": (_t_psum, _j_psum, ("x",), ("x",), (8, 3)),
    "all_gather": (_t_gather, _j_gather, ("x",), (), (8, 3)),
    "psum_scatter": (_t_scatter, _j_scatter, (), ("x",), (8, 3)),
    "all_to_all": (_t_a2a, _j_a2a, ("x",), ("x",), (16, 4)),
    "ppermute": (_t_ppermute, _j_ppermute, ("x",), ("x",), (8, 3)),
    "pmax": (_t_pmax, _j_pmax, ("x",), ("x",), (8, 3)),
    "axis_index": (_t_index, _j_index, ("x",), ("x",), (8, 3)),
    "pmean_replicated_out": (_t_pmean_replicated, _j_pmean_replicated, ("x",), (), (8, 3)),
}


def _mesh(shape, names):
    """A mesh of the classic kind (inputs of any sharding, shard_map places them)."""
    return jax.sharding.Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _inputs(shape, seed):
    g = np.random.default_rng(seed)
    return [g.standard_normal(shape) for _ in range(3)]  # x, tangent, (cotangent drawn later)


def _pshard_worker(names: list[str]) -> dict:
    ps.init_mesh({"x": 4})
    out = {}
    for i, name in enumerate(names):
        body, _, in_spec, out_spec, shape = CASES[name]
        x, tangent, _ = (torch.from_numpy(a) for a in _inputs(shape, i))
        mapped = ps.shard_map(body, in_specs=ps.P(*in_spec), out_specs=ps.P(*out_spec))
        y, vjp = torch.func.vjp(mapped, x)
        cot = torch.from_numpy(np.random.default_rng(100 + i).standard_normal(tuple(y.shape)))
        (grad,) = vjp(cot)
        _, jvp = torch.func.jvp(mapped, (x,), (tangent,))
        out[name] = (y, grad, jvp)
    return out


def _jax_reference(name: str, i: int):
    _, body, in_spec, out_spec, shape = CASES[name]
    mesh = _mesh((4,), ("x",))
    mapped = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=JP(*in_spec), out_specs=JP(*out_spec), check_vma=False
        )
    )
    x, tangent, _ = _inputs(shape, i)
    y, vjp = jax.vjp(mapped, jnp.asarray(x))
    cot = np.random.default_rng(100 + i).standard_normal(y.shape)
    (grad,) = vjp(jnp.asarray(cot))
    _, jvp = jax.jvp(mapped, (jnp.asarray(x),), (jnp.asarray(tangent),))
    return y, grad, jvp


def test_collectives_vjp_and_jvp_against_jax(pool) -> None:
    names = list(CASES)
    got = pool.run(4, _pshard_worker, names, timeout=300)
    for i, name in enumerate(names):
        want = [np.asarray(a) for a in _jax_reference(name, i)]
        for r in range(4):
            for what, g, w in zip(("output", "vjp", "jvp"), got[r][name], want, strict=True):
                np.testing.assert_allclose(g.numpy(), w, err_msg=f"{name} {what} rank {r}", **TOL)


# --------------------------------------------------------------------------- a 2-D mesh


def _t_loss(w, x):
    return ps.psum(((x @ w) ** 2).sum() + torch.sin(w).sum(), ("x", "y"))


def _j_loss(w, x):
    return lax.psum(((x @ w) ** 2).sum() + jnp.sin(w).sum(), ("x", "y"))


def _mesh2d_worker(w, x, ws) -> dict:
    ps.init_mesh({"x": 2, "y": 2})
    mapped = ps.shard_map(_t_loss, in_specs=(ps.P(), ps.P(("x", "y"))), out_specs=ps.P())
    w, x, ws = (torch.from_numpy(a) for a in (w, x, ws))
    return {
        "grad": torch.func.grad(mapped, argnums=(0, 1))(w, x),
        "hessian": torch.func.hessian(mapped)(w, x),
        "vmap": torch.func.vmap(mapped, in_dims=(0, None))(ws, x),
        "vmap_grad": torch.func.vmap(torch.func.grad(mapped), in_dims=(0, None))(ws, x),
    }


def test_shard_map_2d_grad_hessian_vmap_against_jax(pool) -> None:
    g = np.random.default_rng(7)
    w, x, ws = g.standard_normal(3), g.standard_normal((8, 3)), g.standard_normal((5, 3))
    mesh = _mesh((2, 2), ("x", "y"))
    mapped = jax.jit(
        jax.shard_map(
            _j_loss, mesh=mesh, in_specs=(JP(), JP(("x", "y"))), out_specs=JP(), check_vma=False
        )
    )
    want = {
        "grad": jax.grad(mapped, argnums=(0, 1))(w, x),
        "hessian": jax.hessian(mapped)(w, x),
        "vmap": jax.vmap(mapped, in_axes=(0, None))(ws, x),
        "vmap_grad": jax.vmap(jax.grad(mapped), in_axes=(0, None))(ws, x),
    }
    for r, got in enumerate(pool.run(4, _mesh2d_worker, w, x, ws, timeout=300)):
        for key, value in want.items():
            got_leaves = got[key] if isinstance(got[key], tuple) else (got[key],)
            want_leaves = value if isinstance(value, tuple) else (value,)
            for a, b in zip(got_leaves, want_leaves, strict=True):
                np.testing.assert_allclose(a.numpy(), np.asarray(b), err_msg=f"{key} {r}", **TOL)


# --------------------------------------------------------------------------- microbatching


def _t_out(w, x):
    y = torch.tanh(x @ w)
    return y, (y**2).sum(), (y**2).mean()


def _j_out(w, x):
    y = jnp.tanh(x @ w)
    return y, (y**2).sum(), (y**2).mean()


def _t_mean(w, x):
    return (torch.tanh(x @ w) ** 2).mean()


def _j_mean(w, x):
    return (jnp.tanh(x @ w) ** 2).mean()


def test_microbatching_against_optax() -> None:
    ps.init_mesh({"x": 1})
    g = np.random.default_rng(3)
    w, x = g.standard_normal((3, 2)), g.standard_normal((12, 3))
    tw, tx = torch.from_numpy(w), torch.from_numpy(x)
    acc = optax.microbatching.AccumulationType
    k = 4  # microbatches of 3 rows (optax needs equal ones)
    # sum, mean, concat
    ours = ps.pmap_microbatch(_t_out, num_microbatches=k, in_specs=(None, ps.Shard(0)))(tw, tx)
    theirs = optax.microbatch(
        _j_out, argnums=1, microbatch_size=3, accumulator=(acc.CONCAT, acc.SUM, acc.MEAN)
    )(w, x)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a.numpy(), np.asarray(b), **TOL)
    # gradient accumulation: microbatch(grad(f))
    ours = ps.pmap_microbatch(
        torch.func.grad(_t_mean), num_microbatches=k, in_specs=(None, ps.Shard(0))
    )(tw, tx)
    theirs = optax.microbatch(
        jax.grad(_j_mean), argnums=1, microbatch_size=3, accumulator=acc.MEAN
    )(w, x)
    np.testing.assert_allclose(ours.numpy(), np.asarray(theirs), **TOL)
    # and the other nesting: grad(microbatch(f)), with respect to the parameters and the data
    mapped = ps.pmap_microbatch(_t_mean, num_microbatches=k, in_specs=(None, ps.Shard(0)))
    jmapped = optax.microbatch(_j_mean, argnums=1, microbatch_size=3, accumulator=acc.MEAN)
    for argnums in (0, 1):
        ours = torch.func.grad(mapped, argnums=argnums)(tw, tx)
        theirs = jax.grad(jmapped, argnums=argnums)(w, x)
        np.testing.assert_allclose(ours.numpy(), np.asarray(theirs), **TOL)
