"""A tensor-parallel plan resolved against a model: which layer does what, and the spec of every
parameter. Pure: it needs the axis's name and size, no process group.

A plan maps module-name patterns to styles. Patterns are matched name by name (the module's
dotted name and the pattern are cut at the dots; ``fnmatch`` compares the pieces, so ``*``
stands for one name: one layer index). Styles (torch's ``parallelize_module`` styles):

- ``"colwise"``: a projection's output features are split (``nn.Linear``: ``weight``
  ``P(axis, None)``, ``bias`` ``P(axis)``; a layer storing ``(in, out)`` gets the transposed
  specs). Its input is whole; its output this rank's features, gathered when the layer is an
  output head (no ``"rowwise"`` sibling), unless the loss is computed on the split vocabulary.
- ``"rowwise"``: a projection's input features are split (``weight`` ``P(None, axis)``, ``bias``
  whole); its partial outputs are summed over the axis, then the bias added.
- ``"vocab"``: an ``nn.Embedding``'s rows are split; each rank looks up the tokens it holds and
  the rows are summed over the axis.
- ``"sequence"``: Megatron sequence parallelism. The module runs on this rank's share of the
  tokens (dim 1): the first such module (in module order) splits its first argument, the last
  gathers its output, and the activations between them stay split. The projections inside
  those modules gather the tokens before a ``"colwise"`` layer and reduce-scatter them after a
  ``"rowwise"`` one instead of summing.
- ``"replicate"``: left whole (the default for modules no pattern matches).

Attention modules that a model adapter describes (:class:`~pshard._modules.adapter.AttentionHeads`)
are split by heads: their query/key/value projections ``"colwise"`` and their output projection
``"rowwise"`` together, the heads divided by the axis size; with fewer key/value heads than
ranks the key/value projections stay whole and each rank keeps the head its queries use; a
fused q|k|v projection is split part by part (``P(None, (3, axis))``).

Internal interface: ``STYLES``; ``Layer`` (one split module); ``Resolved`` (the plan's layers,
the attention modules to localise, the parameters' specs); ``resolve(model, plan, axis, size,
adapter, fn)``; ``block_shape(spec, whole, size, rank)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from collections.abc import Mapping

from torch import nn

from .._core.global_tensor import applied_shards
from .._core.layout_rules import index_runs
from .._core.placements import P
from .._core.tree import describe
from .._modules.adapter import TensorParallelParts

__all__ = ["STYLES", "Layer", "Resolved", "block_shape", "resolve"]

STYLES = ("colwise", "rowwise", "vocab", "sequence", "replicate")
_PROJECTIONS = ("colwise", "rowwise")


@dataclasses.dataclass(frozen=True)
class Layer:
    """One module the plan splits, and how it runs.

    Attributes:
        name: its name in the model; ``style``: its style (``"gather"``: not in the plan, the
            module holding a parallel pair inside a ``"sequence"`` region, whose first
            argument's tokens are gathered); ``pattern``: the plan's pattern.
        layout: ``"linear"`` (weight ``(out, in)``), ``"transposed"`` (``(in, out)``),
            ``"embedding"``, or ``""`` (``"sequence"``).
        specs: the spec of each of its parameters (``"weight"``, ``"bias"``).
        whole: the whole shape of each of its parameters.
        select: a key/value projection left whole: ``(ranks per kv head, head width)``; each
            rank keeps the head its queries use.
        head: a ``"colwise"`` output head (its features gathered unless the loss is parallel).
        gather_input: inside a ``"sequence"`` region, directly under its module: gather the
            tokens first (colwise).
        scatter_output: inside a ``"sequence"`` region: reduce-scatter the tokens (rowwise).
        split_tokens: the first ``"sequence"`` module: split its first argument's tokens.
        gather_tokens: the last ``"sequence"`` module: gather its output's tokens.
    """

    name: str
    style: str
    pattern: str
    layout: str
    specs: Mapping[str, P]
    whole: Mapping[str, tuple[int, ...]]
    select: tuple[int, int] | None = None
    head: bool = False
    gather_input: bool = False
    scatter_output: bool = False
    split_tokens: bool = False
    gather_tokens: bool = False

    def describe(self) -> str:
        if self.style == "gather":
            return f"gathers the tokens for its layers, e.g. {self.pattern!r}"
        return f"{self.style!r} from pattern {self.pattern!r}"


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A plan resolved against a model for an axis of some size.

    Attributes:
        layers: module name -> :class:`Layer`, in module order.
        attention: ``(module name, local heads, local kv heads)`` of the attention modules
            whose heads are split.
        specs: parameter name (``named_parameters()``) -> spec.
    """

    layers: Mapping[str, Layer]
    attention: tuple[tuple[str, int, int], ...]
    specs: Mapping[str, P]


def block_shape(spec: P, whole: tuple[int, ...], size: int, rank: int) -> tuple[int, ...]:
    """The shape of rank ``rank``'s block of a tensor of shape ``whole`` split by ``spec``
    over one axis of ``size`` ranks (``torch.chunk``'s rule)."""
    pairs = applied_shards(spec)
    runs = index_runs(whole, (size,) * len(pairs), (rank,) * len(pairs), tuple(p for _, p in pairs))
    return tuple(sum(map(len, r)) for r in runs)


def _match(pattern: str, name: str) -> bool:
    pieces, parts = pattern.split("."), name.split(".")
    return len(pieces) == len(parts) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(pieces, parts, strict=True)
    )


def _choose(model: nn.Module, plan: Mapping[str, str], fn: str) -> dict[str, tuple[str, str]]:
    """module name -> (style, pattern) for every module a pattern matches."""
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"{fn}: plan must be a dict of module-name pattern -> style, got {describe(plan)}"
        )
    names = [n for n, _ in model.named_modules() if n]
    chosen: dict[str, tuple[str, str]] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"{fn} plan: a pattern must be a str, got {describe(pattern)}")
        if style not in STYLES:
            raise ValueError(
                f"{fn} plan[{pattern!r}]: unknown style {style!r}; styles are "
                f"{', '.join(map(repr, STYLES))}"
            )
        matched = [n for n in names if _match(pattern, n)]
        if not matched:
            close = difflib.get_close_matches(pattern, names, n=1, cutoff=0.5)
            hint = f" (a module is named {close[0]!r})" if close else ""
            raise ValueError(
                f"{fn} plan[{pattern!r}]: the pattern matches no module of "
                f"{type(model).__name__}{hint}; patterns are matched name by name, '*' "
                f"standing for one name (e.g. 'model.layers.*.mlp.up_proj')"
            )
        for n in matched:
            before = chosen.get(n)
            if before is not None and before[0] != style:
                raise ValueError(
                    f"{fn} plan: module {n!r} is matched by {before[1]!r} ({before[0]!r}) and "
                    f"by {pattern!r} ({style!r}); give each module one style"
                )
            chosen[n] = (style, pattern)
    return chosen


def _layout(name: str, module: nn.Module, style: str, pattern: str, fn: str,
            adapter: TensorParallelParts | None) -> str:  # fmt: skip
    """How a module the plan splits stores its weight, checked against its style."""
    if style == "sequence":
        return ""
    if style == "vocab":
        if not isinstance(module, nn.Embedding):
            _cannot(name, module, style, pattern, fn, "'vocab' splits an nn.Embedding's rows")
        for attr, bad in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False)):
            if getattr(module, attr) != bad:
                raise ValueError(
                    f"{fn}: module {name!r} ({type(module).__name__}) has {attr}="
                    f"{getattr(module, attr)!r}, which a vocabulary split cannot honour (each "
                    f"rank sees only its rows); build the embedding without it"
                )
        return "embedding"
    layout = "linear" if type(module) is nn.Linear else None
    if layout is None and adapter is not None:
        layout = adapter.projection_layout(module)
    if layout is None:
        _cannot(name, module, style, pattern, fn, f"{style!r} splits an nn.Linear (or a "
                f"projection a model adapter knows, e.g. Hugging Face's Conv1D)")  # fmt: skip
    own = sorted(n for n, _ in module.named_parameters(recurse=True))
    if own not in (["weight"], ["bias", "weight"]):
        _cannot(name, module, style, pattern, fn, "a projection holds a weight and a bias only")
    return str(layout)


def _cannot(name: str, module: nn.Module, style: str, pattern: str, fn: str, why: str) -> None:
    raise ValueError(
        f"{fn}: module {name!r} ({type(module).__name__}) is matched by {pattern!r} with style "
        f"{style!r}, which cannot split it: {why}; match it with another pattern or style "
        f"('replicate' leaves it whole)"
    )


def _projection_specs(style: str, layout: str, axis: str, parts: int) -> dict[str, P]:
    split: str | tuple[int | str, ...] = axis if parts == 1 else (parts, axis)
    if style == "colwise":
        weight = P(split, None) if layout == "linear" else P(None, split)
        return {"weight": weight, "bias": P(split)}
    weight = P(None, axis) if layout == "linear" else P(axis, None)
    return {"weight": weight, "bias": P()}


def _attention(
    modules: Mapping[str, nn.Module],
    chosen: Mapping[str, tuple[str, str]],
    size: int,
    fn: str,
    adapter: TensorParallelParts,
) -> tuple[list[tuple[str, int, int]], dict[str, tuple[int, tuple[int, int] | None]]]:
    """The attention modules whose projections the plan splits: ``(name, local heads, local
    kv heads)``; and per projection, its parts (fused) and, for key/value projections left
    whole, ``(ranks per kv head, head width)``."""
    out: list[tuple[str, int, int]] = []
    projections: dict[str, tuple[int, tuple[int, int] | None]] = {}
    for name, module in modules.items():
        heads = adapter.attention_heads(module)
        if heads is None:
            continue
        prefix = f"{name}." if name else ""
        styles = {p: chosen.get(prefix + p, ("replicate", ""))[0]
                  for p in (*heads.projections, heads.output)}  # fmt: skip
        if all(s == "replicate" for s in styles.values()):
            continue
        wanted = {**dict.fromkeys(heads.projections, "colwise"), heads.output: "rowwise"}
        if styles != wanted:
            raise ValueError(
                f"{fn}: the attention module {name!r} ({type(module).__name__}) has its "
                f"projections styled {styles}; its heads are split only with every "
                f"projection of q, k and v 'colwise' and the output projection 'rowwise' "
                f"({wanted}), or left whole all together"
            )
        if heads.heads % size:
            raise ValueError(
                f"{fn}: the attention module {name!r} has {heads.heads} query heads, which the "
                f"axis size {size} does not divide; use an axis size that divides the heads"
            )
        kv = heads.kv_heads
        if kv % size == 0:
            local_kv = kv // size
        elif size % kv == 0:
            local_kv = 1  # the key/value projections stay whole: each rank keeps its head
            for p in heads.kv:
                projections[prefix + p] = (1, (size // kv, heads.head_dim))
        else:
            raise ValueError(
                f"{fn}: the attention module {name!r} has {kv} key/value heads and the axis "
                f"has {size} ranks: neither divides the other, so the heads a rank's queries "
                f"use cannot be its own; use an axis size that {kv} divides or that divides {kv}"
            )
        for p in heads.projections:
            projections.setdefault(prefix + p, (heads.parts, None))
        out.append((name, heads.heads // size, local_kv))
    return out, projections


def resolve(
    model: nn.Module,
    plan: Mapping[str, str],
    axis: str,
    size: int,
    adapter: TensorParallelParts | None,
    fn: str,
) -> Resolved:
    """``plan`` resolved against ``model`` for an axis of ``size`` ranks (see the module docs).

    Raises:
        TypeError, ValueError: the plan's patterns or styles, a module a style cannot split,
            heads the axis size does not divide, tied parameters split two ways.
    """
    chosen = _choose(model, plan, fn)
    modules = dict(model.named_modules())
    attention, projections = (
        _attention(modules, chosen, size, fn, adapter) if adapter is not None else ([], {})
    )
    # the outermost "sequence" modules, in module order: the first splits, the last gathers
    regions = [n for n in modules if chosen.get(n, ("",))[0] == "sequence"]
    regions = [n for n in regions if not any(n.startswith(o + ".") for o in regions)]
    ordered = [n for n in modules if n in chosen and chosen[n][0] != "replicate"]
    layers: dict[str, Layer] = {}
    for name in ordered:
        style, pattern = chosen[name]
        module = modules[name]
        layout = _layout(name, module, style, pattern, fn, adapter)
        whole = {n: tuple(p.shape) for n, p in module.named_parameters()}
        inside = any(name.startswith(r + ".") for r in regions)
        parent = name.rpartition(".")[0]
        siblings = [n for n in chosen if n.rpartition(".")[0] == parent and n != name]
        parts, select = projections.get(name, (1, None))
        if style in _PROJECTIONS:
            specs = _projection_specs(style, layout, axis, parts)
            if select is not None:
                specs = dict.fromkeys(specs, P())
        elif style == "vocab":
            specs = {"weight": P(axis, None)}
        else:
            specs = {}
        specs = {n: specs.get(n, P()) for n in whole}
        layers[name] = Layer(
            name=name,
            style=style,
            pattern=pattern,
            layout=layout,
            specs=specs,
            whole=whole,
            select=select,
            head=style == "colwise" and not any(chosen[s][0] == "rowwise" for s in siblings),
            gather_input=inside
            and style == "colwise"
            and chosen.get(parent, ("",))[0] == "sequence",
            scatter_output=inside and style == "rowwise",
            split_tokens=bool(regions) and name == regions[0],
            gather_tokens=bool(regions) and name == regions[-1],
        )
    # inside a sequence region the tokens are gathered where a parallel pair starts: at the
    # parent of its colwise layers (an attention module reads its input's shape), unless that
    # parent is the region's own module (then at the colwise layer itself)
    for name, layer in list(layers.items()):
        parent = name.rpartition(".")[0]
        if (
            layer.style == "colwise"
            and not layer.gather_input
            and parent
            and any(name.startswith(r + ".") for r in regions)
        ):
            layers.setdefault(parent, Layer(parent, "gather", layer.pattern, "", {}, {}))
    order = list(modules)
    layers = dict(sorted(layers.items(), key=lambda item: order.index(item[0])))
    return Resolved(layers, tuple(attention), _specs(model, layers, fn))


def _specs(model: nn.Module, layers: Mapping[str, Layer], fn: str) -> dict[str, P]:
    """Every parameter's spec; tied parameters must agree."""
    by_tensor: dict[int, tuple[str, P, str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        layer = layers.get(owner)
        spec = layer.specs[attr] if layer is not None and attr in layer.specs else P()
        why = f"{layer.describe()} for {owner!r}" if layer is not None else "left whole"
        before = by_tensor.setdefault(id(param), (name, spec, why))
        if before[1] != spec:
            raise ValueError(
                f"{fn}: the parameters {before[0]!r} and {name!r} are one tensor (tied), but "
                f"the plan splits them as {before[1]!r} ({before[2]}) and {spec!r} ({why}); "
                f"split both alike (an embedding 'vocab' and its tied head 'colwise')"
            )
    return {name: by_tensor[id(p)][1] for name, p in model.named_parameters()}
