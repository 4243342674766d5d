"""ps.spawn(..., backend="threads"): in-process ranks that behave like processes.

Every feature on a 2x2 mesh against gloo processes running the same per-rank code (data
movement bit for bit, reductions to rounding) and against itself (the same numbers every run);
per-rank state (random numbers, default dtype, rank, mesh) as a fresh process has it; failures
that end the run within seconds with no thread left; what cannot run on threads refused.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.func import functional_call, grad, jvp, vmap

import pshard as ps

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

P = ps.P
f64 = torch.float64


def _rank_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pshard-rank")]


@pytest.fixture(autouse=True)
def _no_thread_left():
    yield
    assert _rank_threads() == []


# ------------------------------------------------------------------ every feature, one function


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 6)
        self.down = torch.nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.dropout(torch.tanh(self.up(x)), 0.25))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _every_feature(directory: str) -> dict[str, Any]:
    """Every pshard feature once, on a 2x2 mesh; values that must match gloo's."""
    mesh = ps.init_mesh({"dp": 2, "sp": 2})
    r = dist.get_rank()
    torch.manual_seed(1234)  # the same on every rank: whole inputs are replicated
    x = torch.randn(6, 4, dtype=f64)
    coords = (mesh.get_local_rank("dp"), mesh.get_local_rank("sp"))
    out: dict[str, Any] = {"rank": r, "coords": coords}
    mine = x + r  # differs per rank

    # collectives under transforms
    def coll(t: torch.Tensor) -> torch.Tensor:
        y = ps.all_gather(t, "sp", dim=0) * 2
        y = ps.psum_scatter(y, "dp", dim=0)
        y = ps.all_to_all(y.reshape(-1, 2), ("dp", "sp"), split_dim=0, concat_dim=1)
        y = ps.ppermute(y, "sp", [(0, 1), (1, 0)])
        return (torch.sin(ps.psum(y, "dp")) * ps.pmax(t.sum(), "sp")).sum()

    out["coll"] = coll(mine)
    out["coll_grad"] = grad(coll)(mine)
    out["coll_jvp"] = jvp(coll, (mine,), (torch.ones_like(mine),))[1]
    out["coll_vmap"] = vmap(lambda t: ps.psum(t, "dp"))(mine)

    # shard_map with its gradient
    def sm(w: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        return ps.psum((data @ w).pow(2).sum(), ("dp", "sp"))

    mapped = ps.shard_map(sm, in_specs=(None, P(("dp", "sp"))), out_specs=ps.Replicate())
    w = torch.randn(4, 3, dtype=f64)
    out["shard_map_grad"] = grad(mapped)(w, x)

    # global tensors and FSDP
    torch.manual_seed(7)
    net = _Net().to(f64)
    whole = {k: v.detach().clone() for k, v in net.named_parameters()}
    params = ps.shard(whole, P("dp"))
    out["reshard"] = ps.gather(ps.reshard(params["blocks.0.up.weight"], P(None, "sp")))

    def fsdp_loss(p: dict) -> torch.Tensor:
        return ps.sharded_call(net.eval(), p, (x,)).pow(2).sum()

    grads = grad(fsdp_loss)(params)
    out["fsdp_grad"] = {k: g.local for k, g in grads.items()}

    # checkpoint with dropout (per-rank random numbers, replayed)
    torch.manual_seed(100 + r)
    net.train()
    ck = ps.checkpoint(lambda p, t: functional_call(net, p, (t,)).pow(2).sum())
    out["checkpoint_grad"] = grad(ck)(whole, mine)

    # microbatching with exact token weights
    def mb_loss(wt: torch.Tensor, batch: dict) -> torch.Tensor:
        return ((batch["x"] @ wt).pow(2).sum(-1) * batch["m"]).sum() / batch["m"].sum()

    batch = {"x": x, "m": torch.tensor([1.0, 0, 1, 1, 0, 1], dtype=f64)}
    step = ps.pmap_microbatch(
        grad(mb_loss),
        num_microbatches=3,
        in_specs=(None, ps.Shard(0)),
        out_specs=ps.Partial("mean"),
        weight_fn=lambda wt, b: b["m"].sum(),
    )
    out["microbatch"] = step(w, batch)

    # sequence parallelism: ring and Ulysses attention over "sp"
    q, k, v = (torch.randn(1, 7, 2, 4, dtype=f64) for _ in range(3))
    for name, attention in (("ring", ps.ring_attention), ("ulysses", ps.ulysses_attention)):
        fn = ps.shard_map_seq(
            lambda q, k, v, attention=attention: attention(q, k, v, axis="sp", causal=True),
            axis="sp",
            in_specs=(ps.Shard(1),) * 3,
            out_specs=ps.Shard(1),
            layout="zigzag",
        )
        out[name] = fn(q, k, v)
        out[name + "_grad"] = grad(lambda q, fn=fn: fn(q, k, v).sum())(q)

    # save and load
    path = f"{directory}/ckpt"
    ps.save(path, {"params": params, "step": 3})
    back = ps.load(path, {"params": ps.shard(whole, P("sp")), "step": 0})
    out["loaded"] = {k: g.local for k, g in back["params"].items()}

    # debug mode's checks
    with ps.debug(True):
        out["debug_psum"] = ps.psum(mine, ("dp", "sp"))
    out["random"] = torch.randn(3)  # each rank's own generator
    return out


def _assert_same(a: Any, b: Any, *, exact: bool) -> None:
    import optree

    la, ta = optree.tree_flatten(a)
    lb, tb = optree.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor):
            if exact:
                assert torch.equal(x, y), (x, y)
            else:
                torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
        else:
            assert x == y


def test_every_feature_equal_to_gloo_and_deterministic(pool, procs, tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    first = ps.spawn(_every_feature, str(tmp_path / "a"), nprocs=4, backend="threads")
    again = pool.run(4, _every_feature, str(tmp_path / "b"))
    gloo = procs.run(4, _every_feature, str(tmp_path / "c"))
    for r in range(4):
        first[r].pop("random"), again[r].pop("random"), gloo[r].pop("random")
    _assert_same(first, again, exact=True)
    _assert_same(first, gloo, exact=False)
    assert [o["coords"] for o in first] == [(0, 0), (0, 1), (1, 0), (1, 1)]


# ------------------------------------------------------------------ what a rank owns


def _draws(seeded: bool) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    r = dist.get_rank()
    if seeded:
        torch.manual_seed(r)
    if r == 1:
        torch.set_default_dtype(f64)
    a = torch.randn(4)
    dist.barrier()  # the other ranks run in between
    if r == 0:
        torch.manual_seed(99)  # changes no other rank's draws
    dist.barrier()
    return torch.cat([a, torch.randn(4, dtype=torch.float32)]), torch.zeros(1).dtype, r


def test_each_rank_has_a_fresh_process_random_state_and_default_dtype():
    caller = torch.get_rng_state()
    results = ps.spawn(_draws, True, nprocs=3, backend="threads")
    for r, (draws, dtype, rank) in enumerate(results):
        g = torch.Generator().manual_seed(r)
        want = torch.cat([torch.randn(4, generator=g, dtype=dtype), torch.randn(4, generator=g)])
        if r == 0:  # reseeded between its two draws
            want[4:] = torch.randn(4, generator=torch.Generator().manual_seed(99))
        assert torch.equal(draws, want.float() if dtype == torch.float32 else want.to(draws))
        assert rank == r and dtype == (f64 if r == 1 else torch.float32)
    assert torch.equal(torch.get_rng_state(), caller) and torch.get_default_dtype() == torch.float32
    # unseeded ranks draw like fresh processes: not all the same
    unseeded = ps.spawn(_draws, False, nprocs=2, backend="threads")
    assert not torch.equal(unseeded[0][0][:4], unseeded[1][0][:4].float())


def _identity() -> tuple:
    mesh = ps.init_mesh({"a": 2, "b": 2})
    return (
        dist.get_rank(),
        dist.get_world_size(),
        str(dist.get_backend()),
        ps.current_mesh() is mesh,
        ps.axis_index("b"),
        threading.current_thread().name,
    )


def test_rank_identity_and_per_rank_mesh_leave_the_callers_own_untouched():
    mesh = ps.init_mesh({"solo": 1})  # the caller's own world of one process
    group = dist.group.WORLD
    results = ps.spawn(_identity, nprocs=4, backend="threads")
    assert [r[:5] for r in results] == [(r, 4, "threaded", True, r % 2) for r in range(4)]
    assert ps.current_mesh() is mesh and dist.group.WORLD is group
    assert dist.get_world_size() == 1 and ps.psum(torch.ones(1), "solo").item() == 1.0


def test_arguments_and_results_are_not_copied():
    data = {"x": torch.ones(3)}
    results = ps.spawn(lambda d: (d, d["x"]), data, nprocs=2, backend="threads")
    assert all(d is data and x is data["x"] for d, x in results)


def test_a_lambda_and_a_closure_from_python_c(tmp_path):
    code = (
        "import torch, pshard as ps\n"
        "scale = 3.0\n"
        "def f(x):\n"
        "    ps.init_mesh({'w': 4})\n"
        "    return (lambda t: ps.psum(t * scale, 'w'))(x).item()\n"
        "print(ps.spawn(f, torch.ones(1), nprocs=4, backend='threads'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[12.0, 12.0, 12.0, 12.0]"


# ------------------------------------------------------------------ failures


def _raise_on_rank1() -> None:
    if dist.get_rank() == 1:
        raise KeyError("rank 1 could not go on")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for rank 1


def _return_early_on_rank1() -> str:
    if dist.get_rank() == 1:
        return "left"
    ps.init_mesh({"x": 2})
    ps.psum(torch.ones(1), "x")
    return "done"


def _exit_on_rank1() -> None:
    if dist.get_rank() == 1:
        sys.exit(3)
    dist.barrier()


def _spin() -> None:
    while True:
        pass


def test_an_exception_is_reraised_as_itself_and_releases_the_waiting_ranks():
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="rank 1 could not go on") as info:
        ps.spawn(_raise_on_rank1, nprocs=3, backend="threads")
    assert time.monotonic() - t0 < 10
    assert info.value.__notes__ == [
        "spawn: raised in rank 1 of 3 (threads); ranks 0, 2 were waiting for it and were released"
    ]
    assert ps.spawn(dist.get_rank, nprocs=3, backend="threads") == [0, 1, 2]


def test_a_rank_returning_while_others_wait_names_the_collective():
    with pytest.raises(ps.SpawnError) as info:
        ps.spawn(_return_early_on_rank1, nprocs=2, backend="threads")
    text = str(info.value)
    assert text.startswith(
        "spawn (backend='threads'): the ranks wait for each other in collectives that cannot "
        "complete:\n  rank 0 waits in all_reduce[sum]((1,) float32) on process group"
    ), text
    assert "test_threads.py" in text and "\n  rank 1 returned\n" in text


def test_sys_exit_and_timeout():
    with pytest.raises(ps.SpawnError, match=re.escape("fn called sys.exit(3) in rank 1 of 2")):
        ps.spawn(_exit_on_rank1, nprocs=2, backend="threads")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=re.escape("of 2 still running after the timeout of 1")):
        ps.spawn(_spin, nprocs=2, backend="threads", timeout=1.0)
    assert time.monotonic() - t0 < 10


def _mismatched() -> None:
    ps.init_mesh({"x": 2})
    if dist.get_rank() == 0:
        ps.psum(torch.ones(2), "x")
    else:
        ps.all_gather(torch.ones(2), "x")


def _skips_with_debug() -> None:
    ps.init_mesh({"x": 2})
    with ps.debug(True):
        if dist.get_rank() == 0:
            ps.psum(torch.ones(2), "x")


def test_mismatched_collectives_are_named_not_hung():
    with pytest.raises(ValueError) as info:
        ps.spawn(_mismatched, nprocs=2, backend="threads")
    assert "does not match across its ranks:\n  rank 0: all_reduce[sum]((2,) float32)" in str(
        info.value
    )
    with pytest.raises(ValueError) as info:
        ps.spawn(_skips_with_debug, nprocs=2, backend="threads")
    assert str(info.value).startswith(
        "psum (pshard debug mode): axis rank 1 (global rank 1) of axis 'x' did not reach this "
        "collective and cannot anymore"
    )


# ------------------------------------------------------------------ what does not run on threads


def _nccl() -> None:
    ps.init_mesh({"x": 2}, backend="nccl")


def _compiled() -> torch.Tensor:
    ps.init_mesh({"x": 2})
    return torch.compile(lambda t: ps.psum(t, "x"), backend="eager")(torch.ones(2))


def test_nccl_and_compile_are_clear_errors():
    with pytest.raises(ValueError, match=re.escape("backend='threads'")):
        ps.spawn(_nccl, nprocs=2, backend="threads")
    with pytest.raises(RuntimeError, match=re.escape("torch.compile")):
        ps.spawn(_compiled, nprocs=2, backend="threads")


def _returns_a_global_tensor() -> dict:
    ps.init_mesh({"dp": dist.get_world_size()})
    return {"loss": 1.0, "w": ps.shard(torch.ones(4), P("dp"))}


def test_a_global_tensor_returned_is_refused_on_both_backends(procs):
    """It came back with its mesh pickled (a DeviceMesh warning) and process groups that no
    longer existed: now an error naming where it is and what to return instead."""
    text = (
        "rank 0 of 2 returned a GlobalTensor at result['w'], whose mesh and process groups end "
        "with the run (the caller could not use it); return ps.gather(x) for the whole value, "
        "or x.local for this rank's block"
    )
    with pytest.raises(TypeError, match=re.escape("spawn: " + text)):
        ps.spawn(_returns_a_global_tensor, nprocs=2, backend="threads")
    with pytest.raises(TypeError, match=re.escape(text)):
        procs.run(2, _returns_a_global_tensor)


def _async_save_not_waited(path: str) -> int:
    ps.init_mesh({"dp": 2})
    ps.save(path, {"w": ps.shard(torch.arange(6.0), P("dp")), "step": 3}, async_save=True)
    return dist.get_rank()  # returns at once: the save goes on in its own thread


def test_an_async_save_is_a_thread_of_its_rank(tmp_path, capfd):
    """The save's thread takes turns with the ranks, and a rank's world ends after it, as a
    process waits for its threads: the checkpoint is whole and nothing is printed."""
    path = str(tmp_path / "ckpt")
    assert ps.spawn(_async_save_not_waited, path, nprocs=2, backend="threads") == [0, 1]
    err = capfd.readouterr().err
    assert "Exception" not in err and "Traceback" not in err, err
    back = ps.load(path, {"w": torch.zeros(6), "step": 0})
    assert back["step"] == 3 and torch.equal(back["w"], torch.arange(6.0))


def _checkpointed_collectives() -> dict[str, Any]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from pshard._remat.policies import is_collective

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += is_collective(func)
            return func(*args, **(kwargs or {}))

    ps.init_mesh({"x": 2})
    r = dist.get_rank()
    x = torch.linspace(-1, 1, 6, dtype=f64).reshape(2, 3) * (r + 1)
    w = torch.linspace(0.5, 2, 3, dtype=f64)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = ps.psum(x.sin(), "x")
        z = ps.all_gather(y * w, "x", dim=0)
        return (z.cos() * ps.psum_scatter(z, "x", dim=0).sum()).sum()

    cp = ps.checkpoint_policies
    out: dict[str, Any] = {"plain": grad(f)(x)}
    for name, policy in {
        "nothing": cp.nothing_saveable,
        "all_but_a_name": cp.save_anything_except_these_names("unused"),
        "save_collectives": cp.save_collectives,
        "recompute_collectives": cp.recompute_collectives,
    }.items():
        Count.n = 0
        with Count():
            out[name] = grad(ps.checkpoint(f, policy=policy))(x)
        out[name + " collectives"] = Count.n
    return out


# collectives a step dispatches: forward (psum, all_gather, psum_scatter) and backward (their
# transposes), plus the recompute's three when the policy does not keep what they return
_COUNTS = {"nothing": 9, "all_but_a_name": 6, "save_collectives": 6, "recompute_collectives": 9}


def test_checkpointed_collectives_are_seen_as_on_gloo(procs):
    """ps.checkpoint knows a collective by the communication operator it dispatches; the
    in-process transport's run inside operators of their own (gloo's are c10d's). Unseen, a
    policy that kept the buffer a collective writes had the recompute reduce it again, in
    place: a wrong gradient, silently (or a failed write into a kept expanded tensor)."""
    threads = ps.spawn(_checkpointed_collectives, nprocs=2, backend="threads")
    gloo = procs.run(2, _checkpointed_collectives)
    for t, g in zip(threads, gloo, strict=True):
        assert {
            k[: -len(" collectives")]: v for k, v in t.items() if k.endswith(" collectives")
        } == _COUNTS
        for name, value in t.items():
            if not name.endswith("collectives"):
                torch.testing.assert_close(value, t["plain"], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(value, g[name], rtol=1e-12, atol=1e-12)
        assert g["nothing collectives"] == 9 and g["recompute_collectives collectives"] == 9


def test_checkpointed_collectives_on_gloo_are_kept(procs):
    """Under the policies that keep what collectives return, the recompute does not
    communicate on gloo either (gloo finishes its reduce-scatter in the Work's wait)."""
    gloo = procs.run(2, _checkpointed_collectives)
    counts = {
        k[: -len(" collectives")]: v for k, v in gloo[0].items() if k.endswith(" collectives")
    }
    assert counts == _COUNTS


def _raw_collectives_under_grad() -> torch.Tensor:
    def f(x: torch.Tensor) -> torch.Tensor:
        counts = (x > 1).sum().reshape(1)  # computed from x: a torch.func wrapper under grad
        gathered = torch.empty(2, dtype=torch.int64)
        dist.all_gather_single(gathered, counts)
        total = x.sum().detach().reshape(1).clone()
        dist.all_reduce(total)
        return (x * gathered.sum() * total).sum()

    x = torch.arange(3.0) * (dist.get_rank() + 1)
    return torch.stack([grad(f)(x), grad(ps.checkpoint(f))(x)])


def test_torch_distributed_on_torch_func_wrappers(procs):
    """torch.distributed's own calls on tensors that torch.func wraps (inside ps.checkpoint,
    which runs its function in a level of its own: an FSDP x TP x sequence-parallel step
    exchanges lengths there): the transport reads and writes the tensors under the wrappers,
    as gloo does ("Cannot access storage of TensorWrapper" before)."""
    threads = ps.spawn(_raw_collectives_under_grad, nprocs=2, backend="threads")
    gloo = procs.run(2, _raw_collectives_under_grad)
    for t, g in zip(threads, gloo, strict=True):
        assert torch.equal(t, g)


def test_the_callers_excepthook_is_its_own_after_a_run():
    """Each rank's init_process_group wraps sys.excepthook with its "[rankN]: " prefix: the
    caller's own tracebacks came out as "[rank3]: [rank2]: [rank1]: [rank0]: ..." after a run."""
    hook = sys.excepthook
    ps.spawn(dist.get_rank, nprocs=4, backend="threads")
    assert sys.excepthook is hook


# ------------------------------------------------------------------ what is not a rank's code


def _sleep_in_c() -> None:
    if dist.get_rank() == 1:
        time.sleep(3)  # stuck in C: Python cannot stop it here


def test_a_rank_stuck_in_c_code_is_a_timeout_naming_its_line():
    """The run ends within timeout + 2 s with a TimeoutError naming the rank and where it is
    stuck; the thread is a daemon (it never holds the interpreter's exit)."""
    ps.init_mesh({"dp": 1})  # the caller's own process group, which must outlive the rank
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        ps.spawn(_sleep_in_c, nprocs=2, backend="threads", timeout=0.5)
    assert time.monotonic() - t0 < 0.5 + 2
    text = str(info.value)
    assert "rank 1 of 2 is stuck in _sleep_in_c" in text, text
    assert "test_threads.py" in text and "time.sleep(3)" in text, text
    left = [t for t in threading.enumerate() if t.name.startswith("pshard-rank")]
    assert left and all(t.daemon for t in left)
    for t in left:
        t.join(10)
    # back from its sleep, the rank touched no process group: the caller's is still there
    mesh = ps.init_mesh({"dp": 1})
    assert torch.equal(ps.psum(torch.ones(2), "dp"), torch.ones(2)) and mesh.size() == 1


def _generator():
    yield ps.axis_index("x")


async def _coroutine() -> int:
    return 1


@pytest.mark.parametrize("backend", ["threads", "gloo"])
@pytest.mark.parametrize("fn", [_generator, _coroutine])
def test_a_generator_or_coroutine_function_is_refused_before_any_rank_starts(fn, backend):
    t0 = time.monotonic()
    kind = "a generator function" if fn is _generator else "a coroutine function"
    with pytest.raises(TypeError, match=re.escape(f"spawn: fn ({fn.__name__}) is {kind}")):
        ps.spawn(fn, nprocs=2, backend=backend)
    assert time.monotonic() - t0 < 1  # nothing started


def _collective_in_a_plain_thread() -> None:
    ps.init_mesh({"x": 2})
    box: dict[str, BaseException] = {}

    def work() -> None:
        try:
            ps.psum(torch.ones(1), "x")
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    raise box["error"]


def test_a_thread_a_rank_starts_is_not_a_rank():
    with pytest.raises(RuntimeError, match=re.escape("psum: this thread is not a rank")):
        ps.spawn(_collective_in_a_plain_thread, nprocs=2, backend="threads")
