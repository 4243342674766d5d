"""Hugging Face checkpoints through ps.load / ps.load_metadata / ps.save(format="huggingface"):
a tiny Llama built from a config and saved by save_pretrained (one file, and sharded files with
their index; nothing downloads), loaded on 2 and 4 gloo ranks in several layouts and equal to
the model's weights bit for bit; written back sharded and loaded by
AutoModelForCausalLM.from_pretrained; the directory's traps (other safetensors files beside
the model's, a truncated file, a file the index names missing, dtypes) on one process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import spied, spy

import pshard as ps
import pshard._state.hf as hf
from pshard._state.load import load, load_metadata
from pshard._state.manifest import SavedTensor
from pshard._state.save import save

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)

P = ps.P


def _llama(dtype: torch.dtype = torch.float32) -> Any:
    """A tiny Llama from a config (vocabulary 97: its rows split unevenly)."""
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # norms that are not all ones, so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p))
    return model


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _saved(model: Any, path: Path, sharded: bool) -> str:
    model.save_pretrained(path, **({"max_shard_size": "20KB"} if sharded else {}))
    names = os.listdir(path)
    assert ("model.safetensors.index.json" in names) == sharded
    return str(path)


def _layout(name: str, ndim: int, axes: tuple[str, ...]) -> P:
    """``rows``: dim 0 split over every axis; ``columns``: dim 1 (vectors replicated);
    ``grid``: dim 0 over the first axis and dim 1 over the second."""
    over = axes[0] if len(axes) == 1 else axes
    if name == "rows":
        return P(over)
    if ndim < 2:
        return P()
    return P(None, over) if name == "columns" else P(*axes)


# --------------------------------------------------------------------------- on ranks


def _planned(items: list[Any], reader: Any, plan: Any, planner: Any) -> None:
    items.extend(plan.items)


def _reads_spied() -> Any:
    return spy(hf.HFReader, "read_data", _planned)


def _load_worker(paths: list[str], mesh: dict[str, int], layouts: list[str], out: str) -> Any:
    ps.init_mesh(mesh)
    axes = tuple(mesh)
    got: dict[str, Any] = {}
    last: Any = None
    for path in paths:
        meta = load_metadata(path)
        assert all(isinstance(e, SavedTensor) and e.spec is None for e in meta.values())
        for name in layouts:
            spec = {k: _layout(name, len(e.shape), axes) for k, e in meta.items()}
            items: list[Any] = spied([])  # what this rank's reader is asked for
            like = {k: dataclasses.replace(e, spec=spec[k]) for k, e in meta.items()}
            last = load(path, like)
            # each rank reads exactly the elements of its blocks
            assert sum(math.prod(i.lengths) for i in items) == sum(
                g.local.numel() for g in last.values()
            )
            for k, g in last.items():
                want = P(*spec[k], *[None] * (len(g.shape) - len(spec[k])))
                assert isinstance(g, ps.GlobalTensor) and g.spec == want, (k, g.spec)
            got[f"{Path(path).name}/{name}"] = {k: ps.gather(g) for k, g in last.items()}
    if out:  # write the last layout back, each rank its blocks
        save(out, last, format="huggingface")
    return got


def _check(results: list[Any], weights: dict[str, torch.Tensor], count: int) -> None:
    for got in results:
        assert len(got) == count
        for loaded in got.values():
            assert loaded.keys() == weights.keys()
            for k, w in weights.items():
                assert loaded[k].dtype == w.dtype and torch.equal(loaded[k], w), k


def test_two_ranks_load_a_saved_pretrained_model_and_write_it_back(
    pool: Any, tmp_path: Path
) -> None:
    model = _llama()
    weights = _weights(model)
    paths = [_saved(model, tmp_path / "sharded", True), _saved(model, tmp_path / "single", False)]
    out = tmp_path / "export"
    with _reads_spied():
        results = pool.run(2, _load_worker, paths, {"dp": 2}, ["rows", "columns"], str(out))
    _check(results, weights, 4)
    assert sorted(os.listdir(out)) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == weights.keys()
    model.config.save_pretrained(out)
    again = transformers.AutoModelForCausalLM.from_pretrained(out)
    back = again.state_dict()
    assert back.keys() == weights.keys()
    for k, w in weights.items():
        assert back[k].dtype == w.dtype and torch.equal(back[k], w), k


def test_four_ranks_load_bfloat16_weights_in_three_layouts(pool: Any, tmp_path: Path) -> None:
    model = _llama(torch.bfloat16)
    weights = _weights(model)
    paths = [_saved(model, tmp_path / "sharded", True)]
    with _reads_spied():
        results = pool.run(
            4, _load_worker, paths, {"dp": 2, "tp": 2}, ["rows", "columns", "grid"], ""
        )
    _check(results, weights, 3)


# --------------------------------------------------------------------------- one process


def test_only_the_model_files_are_read(tmp_path: Path) -> None:
    """Other safetensors files in the directory (an adapter, a stale copy holding the same
    keys with other values) are not the model's: the index says which files are."""
    model = _llama()
    weights = _weights(model)
    path = _saved(model, tmp_path / "m", True)
    from safetensors.torch import save_file

    save_file({k: torch.zeros_like(v) for k, v in weights.items()}, f"{path}/stale.safetensors")
    back = load(path, load_metadata(path))
    assert all(torch.equal(back[k], w) for k, w in weights.items())


def test_a_truncated_file_and_a_missing_one_are_named(tmp_path: Path) -> None:
    path = _saved(_llama(), tmp_path / "m", True)
    meta = load_metadata(path)
    index = json.loads(Path(path, "model.safetensors.index.json").read_text())["weight_map"]
    name = index["model.embed_tokens.weight"]
    file = Path(path) / name
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ValueError) as info:
        load(path, meta)
    assert re.fullmatch(
        re.escape(
            f"load: the Hugging Face checkpoint at {path!r} is damaged: its file {name!r} has "
            f"{size - 10} bytes but its header puts "
        )
        + rf"'model\.[\w.]+' at bytes \d+\.\.{size}"
        + re.escape(", so it is truncated; restore it or load another checkpoint"),
        str(info.value),
    ), str(info.value)
    file.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"its file {name!r}, which the index")):
        load_metadata(path)


def test_dtypes_are_compared_not_cast(tmp_path: Path) -> None:
    path = _saved(_llama(torch.bfloat16), tmp_path / "m", False)
    meta = load_metadata(path)
    like = {k: dataclasses.replace(e, dtype=torch.float32) for k, e in meta.items()}
    with pytest.raises(
        ValueError,
        match=re.escape(
            "like['model.norm.weight'] ('model.norm.weight'): the checkpoint holds a bfloat16 "
            "tensor of shape (32,), like a float32 tensor of shape (32,)"
        ),
    ):
        load(path, like)


def test_format_huggingface_writes_weights_only(tmp_path: Path) -> None:
    ps.init_mesh({"dp": 1})
    with pytest.raises(
        TypeError,
        match=re.escape("save tree['step']: format='huggingface' writes a model's weights only"),
    ):
        save(tmp_path / "a", {"w": torch.ones(2), "step": 3}, format="huggingface")
    with pytest.raises(
        TypeError,
        match=re.escape(
            "save tree['mask']: format='huggingface' writes float16, float32, float64, int8, "
            "uint8, int16, int32, int64, bfloat16, not bool; cast it first"
        ),
    ):
        save(tmp_path / "b", {"mask": torch.ones(2, dtype=torch.bool)}, format="huggingface")
    with pytest.raises(ValueError, match=re.escape("save: format must be 'dcp'")):
        save(tmp_path / "c", {"w": torch.ones(2)}, format="safetensors")  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def test_load_with_specs_and_save_with_the_config(tmp_path: Path) -> None:
    """ps.load(path, specs=...) reads straight into GlobalTensors of the specs (it took
    load_metadata and a dataclasses.replace per key); ps.save(..., format="huggingface",
    config=model.config) writes config.json too, so from_pretrained loads the directory alone
    (bit for bit), and a second save with the config replaces it."""
    ps.init_mesh({"tp": 1})
    model = _llama()
    weights = _weights(model)
    path = _saved(model, tmp_path / "in", sharded=True)
    specs = ps.tensor_parallel_specs(model)
    got = ps.load(path, specs=specs)
    assert got.keys() == weights.keys()
    for k, g in got.items():
        want = P(*specs[k], *[None] * (len(g.shape) - len(specs[k])))
        assert isinstance(g, ps.GlobalTensor) and g.spec == want, (k, g.spec)
        assert torch.equal(ps.gather(g), weights[k]), k
    whole = ps.load(path, specs=None)  # None: every tensor whole
    assert all(type(v) is torch.Tensor and torch.equal(v, weights[k]) for k, v in whole.items())
    with pytest.raises(TypeError, match=re.escape("load: give either like")):
        ps.load(path, whole, specs=None)
    with pytest.raises(TypeError, match=re.escape("load specs['lm_head.weight']: a str ('rows')")):
        ps.load(path, specs={**specs, "lm_head.weight": "rows"})
    out = tmp_path / "out"
    for _ in range(2):  # the second replaces the first, config.json included
        ps.save(out, got, format="huggingface", config=model.config)
    assert "config.json" in os.listdir(out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    for k, v in back.state_dict().items():
        assert torch.equal(v, weights[k]), k
    with pytest.raises(TypeError, match=re.escape("save: config is a dict")):
        ps.save(tmp_path / "x", got, format="huggingface", config={"a": 1})
    with pytest.raises(TypeError, match=re.escape("save: config= is written beside")):
        ps.save(tmp_path / "y", got, config=model.config)
    # without config=, a config.json beside the weights is not pshard's to delete
    with pytest.raises(ValueError, match=re.escape("entries pshard did not write: 'config.json'")):
        ps.save(out, got, format="huggingface")
