"""ps.init_sharded: a meta module's parameters drawn block by block.

The whole (ps.gather) is the same on 1, 2 and 4 ranks in several layouts (uneven, strided,
replicated, 2-D), and changes with the seed and the parameter's name; the distributions are
the initialisers' (torch's reset_parameters, a Hugging Face Llama's weight initialisation:
bounds, means and standard deviations of large tensors, zeros and ones exact, an embedding's
padding row zero); per rank, the bytes alive during the call (counted allocation by
allocation) never exceed the rank's blocks plus two tiles, on a model larger than the budget
of one rank; initialisers that need the whole value are refused, naming the parameter; the
module is left as it was.
"""

from __future__ import annotations

import contextvars
import math
import re
import threading
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import pshard as ps
from pshard._state.init import TILE

P = ps.P


class Block(nn.Module):
    def __init__(self, width: int = 96, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=3)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width, bias=False)
        self.norm = nn.LayerNorm(width)
        self.twin = nn.Linear(width, 2 * width)  # the shape of `up`: other values


def _meta_block() -> Block:
    with torch.device("meta"):
        return Block()


SPECS_2x2 = {
    "embed.weight": P(("tp", "dp")),  # 50 rows on 4: strided, uneven
    "up.weight": P("dp", "tp"),
    "up.bias": P(("dp", "tp")),
    "down.weight": P(None, "tp"),
    "norm.weight": P(),
    "norm.bias": P("dp"),
    "twin.weight": P("tp"),
    "twin.bias": None,
}


def _gathered(specs: Any, shape: dict[str, int], seed: int = 7) -> dict[str, torch.Tensor]:
    ps.init_mesh(shape)
    model = _meta_block()
    params = ps.init_sharded(model, specs, seed=seed)
    assert all(p.is_meta for p in model.parameters())  # the module is left as it was
    return ps.gather(params)


def _gathered_2x2() -> dict[str, torch.Tensor]:
    return _gathered(SPECS_2x2, {"dp": 2, "tp": 2})


def _gathered_2() -> dict[str, torch.Tensor]:
    return _gathered(P("x"), {"x": 2})


def test_the_same_whole_on_1_2_and_4_ranks(pool: Any) -> None:
    one = _gathered(P("dp"), {"dp": 1})
    for results in (pool.run(4, _gathered_2x2), pool.run(2, _gathered_2)):
        for got in results:
            assert list(got) == list(one)
            for name, value in got.items():
                assert torch.equal(value, one[name]), name
    again = _gathered(None, {"dp": 1})
    assert all(torch.equal(again[k], one[k]) for k in one)
    other = _gathered(None, {"dp": 1}, seed=8)
    assert not torch.equal(other["up.weight"], one["up.weight"])
    assert not torch.equal(one["twin.weight"], one["up.weight"])  # another name, other values


def test_distributions_of_torch_modules() -> None:
    ps.init_mesh({"dp": 1})
    with torch.device("meta"):
        model = nn.ModuleDict(
            {
                "linear": nn.Linear(1024, 512),
                "embed": nn.Embedding(2000, 64, padding_idx=5),
                "norm": nn.LayerNorm(512),
            }
        )
    got = {k: v.local for k, v in ps.init_sharded(model, None, seed=0).items()}
    bound = 1 / math.sqrt(1024)
    for name in ("linear.weight", "linear.bias"):
        x = got[name].double()
        assert x.dtype == torch.float64 and x.abs().max() <= bound
        assert x.abs().max() > 0.99 * bound
        n = x.numel()
        assert abs(x.mean()) < 4 * bound / math.sqrt(3 * n)
        assert abs(x.std() / (bound / math.sqrt(3)) - 1) < 5 / math.sqrt(n)
    embed = got["embed.weight"].double()
    assert torch.equal(embed[5], torch.zeros(64, dtype=torch.float64))
    rows = torch.cat([embed[:5], embed[6:]])
    assert abs(rows.mean()) < 4 / math.sqrt(rows.numel())
    assert abs(rows.std() - 1) < 5 / math.sqrt(rows.numel())
    assert torch.equal(got["norm.weight"], torch.ones(512))
    assert torch.equal(got["norm.bias"], torch.zeros(512))


def test_a_hugging_face_llama(pool: Any) -> None:
    pytest.importorskip("transformers")
    one = _llama_worker(1)
    two = pool.run(2, _llama_worker, 2)
    for got in two:
        assert all(torch.equal(got[k], one[k]) for k in one)
    for name, x in one.items():
        x = x.double()
        if name.endswith("norm.weight"):
            assert torch.equal(x, torch.ones_like(x)), name
            continue
        if name == "model.embed_tokens.weight":
            assert torch.equal(x[0], torch.zeros_like(x[0]))  # pad_token_id 0
            x = x[1:]
        n = x.numel()
        assert abs(x.mean()) < 4 * 0.02 / math.sqrt(n), name
        assert abs(x.std() / 0.02 - 1) < 5 / math.sqrt(n), name


def _llama_worker(ranks: int) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ps.init_mesh({"dp": ranks})
    params = ps.init_sharded(model, P("dp"), seed=3)
    assert list(params) == [name for name, _ in model.named_parameters()]
    assert not any("_is_hf_initialized" in m.__dict__ for m in model.modules())
    return ps.gather(params)


def test_threads_sharing_one_module() -> None:
    """Ranks that are threads may pass the same module: each swaps its stand-ins in turn."""
    mesh = ps.init_mesh({"dp": 1})
    model = _meta_block()
    results: list[dict[str, torch.Tensor]] = []

    def rank() -> None:
        with ps.use_mesh(mesh):
            for _ in range(3):
                results.append(ps.gather(ps.init_sharded(model, None, seed=7)))

    threads = [threading.Thread(target=contextvars.copy_context().run, args=(rank,))
               for _ in range(3)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    one = _gathered(None, {"dp": 1})
    assert len(results) == 9
    assert all(torch.equal(r[k], one[k]) for r in results for k in one)


# --------------------------------------------------------------------------- memory


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors ops allocate while they live, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in [*args, *(kwargs or {}).values()]
            if isinstance(a, torch.Tensor) and a.device.type == "cpu"
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in inputs or storage.nbytes() == 0:
                continue
            size = storage.nbytes()
            self.live += size
            self.largest = max(self.largest, size)
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, size)
        return out

    def _free(self, size: int) -> None:
        self.live -= size


class Big(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))


def _memory_worker(width: int, layers: int) -> tuple[int, int, int]:
    mesh = ps.init_mesh({"dp": 2, "tp": 2})
    with torch.device("meta"):
        model = Big(width, layers)
    specs = {f"layers.{i}.weight": P("dp", "tp") if i % 2 else P(None, ("tp", "dp"))
             for i in range(layers)}  # fmt: skip
    specs.update({f"layers.{i}.bias": P(("dp", "tp")) for i in range(layers)})
    counter = _LiveBytes()
    with counter:
        params = ps.init_sharded(model, specs, seed=0, mesh=mesh)
    held = sum(p.local.untyped_storage().nbytes() for p in params.values())
    return counter.peak, counter.largest, held


def test_each_rank_draws_only_its_blocks(pool: Any) -> None:
    width, layers = 1024, 8  # 32 MiB whole in float32; a rank's budget: 12 MiB
    whole = layers * (width * width + width) * 4
    budget = 12 << 20
    assert whole > 2 * budget
    tile, block = TILE * 4, width * width  # bytes: float32, a quarter of a weight
    for peak, largest, held in pool.run(4, _memory_worker, width, layers):
        assert held == whole // 4
        assert largest <= max(tile, block)  # a tile, or a weight's block
        assert peak <= held + 2 * tile < budget, (peak, held)


# --------------------------------------------------------------------------- refusals


class Orthogonal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        self.b = nn.Parameter(torch.empty(4))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.b)
        nn.init.orthogonal_(self.w)


class Truncated(Orthogonal):
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.b)
        nn.init.trunc_normal_(self.w, std=0.02)


class Unset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))  # lost on the meta device; nothing resets it
        self.linear = nn.Linear(3, 3)


class Half(Orthogonal):
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.b[:2])
        nn.init.normal_(self.w)


REFUSALS = {
    "orthogonal": (
        Orthogonal,
        "init_sharded: the initialiser of parameter 'w' copies a tensor into it; "
        "init_sharded draws each rank's blocks tile by tile",
    ),
    "trunc_normal": (
        Truncated,
        "init_sharded: the module's initialiser (reset_parameters) failed on pshard's "
        "stand-ins for its parameters (after writing 'w'): RuntimeError",
    ),
    "no initialiser": (
        Unset,
        "init_sharded: parameter 'scale' (shape (3,)) is not initialised by the module's "
        "initialiser (reset_parameters)",
    ),
    "in part": (Half, "init_sharded: parameter 'b' (shape (4,)) is not initialised in full"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_parameter(case: str) -> None:
    ps.init_mesh({"dp": 1})
    cls, message = REFUSALS[case]
    with torch.device("meta"):
        model = cls()
    with pytest.raises(ValueError, match=re.escape(message)):
        ps.init_sharded(model, None, seed=0)


def test_spec_errors_name_the_parameter() -> None:
    ps.init_mesh({"dp": 1})
    with torch.device("meta"):
        linear = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=re.escape("init_sharded specs: the spec is a dict")):
        ps.init_sharded(linear, {"weight": P("dp")}, seed=0)
    with pytest.raises(ValueError, match=re.escape("specs['bias']: P('dp', None) has 2 entries")):
        ps.init_sharded(linear, {"weight": P("dp"), "bias": P("dp", None)}, seed=0)


def _runs_worker(shared: Any) -> Any:
    ps.init_mesh({"dp": 2})
    params = ps.init_sharded(shared, P("dp"), seed=5)
    ids = torch.arange(16).reshape(2, 8) % 40
    out = ps.sharded_call(shared, params, (), {"input_ids": ids, "labels": ids})
    return out.loss, ps.gather(params)


def test_a_meta_built_model_runs_after_init_sharded(pool: Any) -> None:
    """The buffers a module computes are materialised by its own code (a Llama's rotary
    inv_freq, a BatchNorm's running statistics), so sharded_call runs the meta-built model with
    nothing rebuilt by hand, on 2 thread ranks sharing it; the loss is the model's own on the
    gathered weights."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    (loss, whole), (loss1, _) = pool.run(2, _runs_worker, model)
    real = transformers.LlamaForCausalLM(config)
    for name, b in model.named_buffers():
        assert b.device.type == "cpu" and torch.equal(b, real.get_buffer(name)), name
    ids = torch.arange(16).reshape(2, 8) % 40
    want = torch.func.functional_call(real, whole, (), {"input_ids": ids, "labels": ids}).loss
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(loss1, want)
    ps.init_mesh({"dp": 1})
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ps.init_sharded(net, P("dp"), seed=0)
    assert torch.equal(net[1].running_mean, torch.zeros(4))
    assert torch.equal(net[1].running_var, torch.ones(4))
    assert net[1].num_batches_tracked.item() == 0
