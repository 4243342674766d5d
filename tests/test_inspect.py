"""ps.visualize_sharding and ps.memory_estimate against the blocks themselves: the cells of the
grid against which ranks really hold each element (blocks of an arange, on 4 thread ranks) for
1-D, 2-D, partly replicated, replicated, uneven and strided layouts, DTensors and (block, spec)
pairs; the estimate against the bytes ps.shard and optimizer.init really make on each rank."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import pshard as ps
from pshard._inspect.visualize import cells

P = ps.P

LAYOUTS = [
    (P("dp", "tp"), (8, 6)),  # 2-D
    (P("dp"), (7,)),  # 1-D, uneven
    (P(None, "tp"), (4, 5)),  # partly replicated (over dp), uneven columns
    (P(), (4, 4)),  # replicated
    (P(("dp", "tp")), (10,)),  # both axes on one dim, uneven
    (P(("tp", "dp")), (6, 3)),  # the minor axis first: each rank's rows are not where dp says
    (P("tp", "dp"), (3, 5)),  # uneven both ways
]


def _holders(spec: P, shape: tuple[int, ...]) -> Any:
    """Per element of the value, the global ranks whose block holds it (from real blocks of
    an arange) and what visualize_sharding draws of it."""
    ps.init_mesh({"dp": 2, "tp": 2})
    x = ps.shard(torch.arange(float(torch.Size(shape).numel())).reshape(shape), spec)
    mine = set(x.local.flatten().long().tolist())
    everyone = [None] * 4
    torch.distributed.all_gather_object(everyone, mine)
    text = ps.visualize_sharding(x, use_color=False)
    again = ps.visualize_sharding(ps.to_dtensor(x), use_color=False)
    pair = ps.visualize_sharding((x.local, spec), use_color=False)
    return everyone, cells(x.meta), text, again, pair


def test_cells_name_the_ranks_that_hold_each_element(pool: Any, capsys: Any) -> None:
    for spec, shape in LAYOUTS:
        results = pool.run(4, _holders, spec, shape)
        held, (rows, cols, grid), text, again, pair = results[0]
        assert again == text and pair == text, (spec, shape)  # DTensor, (block, spec) alike
        assert all(r[2] == text for r in results)
        numel = torch.Size(shape).numel()
        width = shape[1] if len(shape) == 2 else 0
        seen = set()
        for i in range(len(rows) - 1):
            for j in range(len(cols) - 1):
                ranks = grid[i][j]
                for a in range(rows[i], rows[i + 1]):
                    for b in range(cols[j], cols[j + 1]):
                        e = a * width + b if width else b
                        want = [r for r in range(4) if e in held[r]]
                        assert ranks == want, (spec, shape, e, ranks, want)
                        seen.add(e)
        assert seen == set(range(numel))
        # the labels are the cells' ranks, and nothing but them carries digits
        labels = re.findall(r"[\d,\-]+", text)
        want_labels = sorted({",".join(map(str, c)) if len(c) < 3 else f"{c[0]}-{c[-1]}"
                              for row in grid for c in row})  # fmt: skip
        assert sorted(set(labels)) == want_labels, (spec, labels)


def test_uneven_blocks_are_drawn_to_scale() -> None:
    ps.init_mesh({"dp": 1})
    from pshard._core.global_tensor import GlobalMeta, MeshKey

    key = MeshKey(("dp",), (2,), (0, 1), "cpu")
    text = (
        ps.visualize_sharding(
            ps.GlobalTensor(torch.zeros(6), GlobalMeta(P("dp"), key, (9,), None)), use_color=False
        )
        if False
        else None
    )  # (a GlobalTensor of another world is not built here)
    del text
    x = ps.shard(torch.zeros(5), P("dp"))  # one rank: one cell
    assert "0" in ps.visualize_sharding(x, use_color=False)
    meta = GlobalMeta(P("dp"), key, (9,), None)
    from pshard._inspect.visualize import draw

    picture, _, widths, _ = draw(meta)
    assert widths[0] / widths[1] == pytest.approx(5 / 4, rel=0.05), widths  # 5 and 4 elements


def test_visualize_errors() -> None:
    ps.init_mesh({"dp": 1})
    with pytest.raises(ValueError, match="visualize_sharding: a value of 3 dims"):
        ps.visualize_sharding(ps.shard(torch.zeros(2, 2, 2), P("dp")))
    with pytest.raises(TypeError, match="visualize_sharding: x must be a GlobalTensor"):
        ps.visualize_sharding(torch.zeros(2))


def test_colour_with_rich(capsys: Any) -> None:
    pytest.importorskip("rich")
    ps.init_mesh({"dp": 1})
    text = ps.visualize_sharding(ps.shard(torch.zeros(4), P("dp")), use_color=True)
    printed = capsys.readouterr().out
    assert "┌" in text and "\x1b" not in text  # the returned text is plain
    assert printed.strip()


# --------------------------------------------------------------------------- memory_estimate


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(10, 22)
        self.down = torch.nn.Linear(22, 10)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(37, 10)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))


SPECS = {"embed.weight": P("dp", "tp"), "blocks.*": None}


def _specs(model: torch.nn.Module) -> dict[str, Any]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = P(("tp", "dp")) if p.dim() == 2 else P("dp")  # uneven and strided
    out["embed.weight"] = P("dp", "tp")
    return out


def _measured(model: torch.nn.Module) -> tuple[dict[str, int], dict[str, int]]:
    ps.init_mesh({"dp": 2, "tp": 2})
    specs = _specs(model)
    params = ps.shard({k: v.detach() for k, v in model.named_parameters()}, specs)
    opt = ps.optim.adamw(1e-3)
    state = opt.init(params)
    size = sum(p.local.numel() * p.local.element_size() for p in params.values())
    held = sum(t.local.numel() * t.local.element_size() for t in (*state.mu.values(),
                                                                  *state.nu.values()))  # fmt: skip
    held += state.count.numel() * state.count.element_size()  # the step count
    with torch.device("meta"):
        skeleton = _Model()
    estimate = ps.memory_estimate(skeleton, specs, optimizer=opt)
    from_params = ps.memory_estimate(params, None, optimizer=opt)
    assert from_params["params"] == estimate["params"]
    return {"params": size, "grads": size, "optimizer": held}, estimate


def test_memory_estimate_equals_the_blocks(pool: Any) -> None:
    torch.manual_seed(0)
    model = _Model()
    for measured, estimate in pool.run(4, _measured, model):
        for k, v in measured.items():
            assert estimate[k] == v, (k, estimate, measured)
    unit = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert estimate["gathered_unit"] == max(unit, 37 * 10 * 4)
    half = ps.memory_estimate(model, None, param_dtype=torch.bfloat16, mesh={"dp": 2})
    assert half["gathered_unit"] == max(unit, 37 * 10 * 4) // 2


def test_memory_estimate_of_a_large_model_on_a_dict_mesh() -> None:
    """A 4096-wide, 32-layer stack on 64 ranks, built on the meta device: nothing allocated;
    rank 0's blocks (the largest under torch.chunk's sizes)."""
    with torch.device("meta"):
        layers = torch.nn.ModuleList(torch.nn.Linear(4096, 4097) for _ in range(32))
    est = ps.memory_estimate(layers, P(("dp", "tp")), optimizer=ps.optim.adamw(1e-3),
                             mesh={"dp": 8, "tp": 8})  # fmt: skip
    per_weight = -(-4096 // 64) * 4097 * 4  # dim 0 (4097 rows) split 64 ways, ceil
    rows = -(-4097 // 64)
    assert est["params"] == 32 * (rows * 4096 * 4 + rows * 4), (est, per_weight)
    assert est["optimizer"] == 2 * est["params"] + 8  # the moments and the step count
    assert est["gathered_unit"] == (4097 * 4096 + 4097) * 4
    with pytest.raises(TypeError, match="memory_estimate: mesh must be"):
        ps.memory_estimate(layers, None, mesh=[8])
