"""ps.save / ps.load / ps.load_metadata on one process: the shared corpus of pytrees round trips,
plain values and RNG states as JSON, DCP reading pshard's files and the other way round, the
restricted metadata unpickler, the atomic switch (the path never missing, the symlink fallback,
replacing a DCP directory, stale aside directories), async saves keeping the values at the call,
and the errors (pinned).

Multi-process saves and loads (layouts across meshes and world sizes, read plans, resume,
FSDP2 interop, a killed save) are in ``test_state_dist.py``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import json
import math
import os
import pickle
import re
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import optree
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import TREES, assert_trees_equal

import pshard as ps
import pshard._state.atomic as atomic
from pshard._core.tree import tree_flatten_with_path
from pshard._state.load import load, load_metadata
from pshard._state.manifest import (
    MANIFEST,
    SavedObject,
    SavedTensor,
    fqn,
    key_path,
    value_from_json,
    value_to_json,
)
from pshard._state.reader import read_dcp_metadata
from pshard._state.rng import RngState
from pshard._state.save import save

# DCP warns that it runs without a process group when a test reads with dcp.load on one process
no_dist_warning = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SAVEABLE = [(name, tree) for name, tree in TREES if name != "block_mask"]


def _ckpt(tmp_path: Path) -> str:
    return str(tmp_path / "ckpt")


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name,tree", SAVEABLE, ids=[n for n, _ in SAVEABLE])
def test_corpus_round_trips(tmp_path: Path, name: str, tree: Any) -> None:
    """Every tree of the corpus (but the BlockMask) saves and loads back into itself, and
    load_metadata's tree is a like that reads the same leaves."""
    path = _ckpt(tmp_path)
    save(path, tree)
    back = load(path, tree)
    assert_trees_equal(back, tree)
    again = _by_key(load(path, load_metadata(path)))
    want = _by_key(back)
    assert again.keys() == want.keys()
    for key, x in want.items():
        y = again[key]
        assert type(x) is type(y), key
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, key


def _by_key(tree: Any) -> dict[str, Any]:
    """The leaves of ``tree`` by DCP key (key paths joined by '.')."""
    paths, leaves, _ = tree_flatten_with_path(tree, none_is_leaf=True)
    return {fqn(key_path(p, "test")): x for p, x in zip(paths, leaves, strict=True)}


def test_load_metadata_rebuilds_the_tree(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    Pair = dict(TREES)["namedtuple"].__class__
    tree = {
        "model": {"w": torch.ones(3, 2, dtype=torch.float64), "b": torch.zeros(2)},
        "opt": [torch.ones(1), (7, None)],
        "pair": Pair(torch.ones(4), 5),
        "empty": {},
        "rng": RngState.capture(),
        "lr": 1e-3,
    }
    save(path, tree)
    meta = load_metadata(path)
    assert meta == {
        "empty": {},
        "lr": 1e-3,
        "model": {
            "b": SavedTensor((2,), torch.float32),
            "w": SavedTensor((3, 2), torch.float64),
        },
        "opt": [SavedTensor((1,), torch.float32), (7, None)],
        "pair": dict(zip(Pair._fields, [SavedTensor((4,), torch.float32), 5], strict=True)),
        "rng": tree["rng"],
    }
    whole = load(path, meta)
    assert torch.equal(whole["model"]["w"], tree["model"]["w"]) and whole["opt"][1] == (7, None)


def test_plain_values_are_json_with_their_types() -> None:
    for value in (0, -(2**70), 0.1, -0.0, 1e308, "", "ünï", True, False):
        data = value_to_json(value)
        back = value_from_json(json.loads(json.dumps(data, allow_nan=False)))
        assert type(back) is type(value) and back == value and repr(back) == repr(value)
    for value in (math.inf, -math.inf):
        assert value_from_json(json.loads(json.dumps(value_to_json(value)))) == value
    assert math.isnan(value_from_json(json.loads(json.dumps(value_to_json(math.nan)))))
    assert value_to_json(True) == {"bool": True} and value_to_json(1) == {"int": 1}


def test_rng_state_is_plain_data_and_restores_the_draws(tmp_path: Path) -> None:
    torch.manual_seed(3)
    state = RngState.capture()
    a = torch.rand(5)
    assert RngState.from_json(json.loads(json.dumps(state.to_json()))) == state
    path = _ckpt(tmp_path)
    save(path, {"rng": state})
    text = (Path(path) / MANIFEST).read_text()
    assert json.loads(text)["leaves"][0]["states"][0]["cpu"]  # base64 text, in the JSON
    load(path, {"rng": RngState(b"")})["rng"].restore()
    assert torch.equal(torch.rand(5), a)


def test_files_hold_no_pickle_of_pshard_values(tmp_path: Path) -> None:
    """Plain values live in pshard.json only: DCP's metadata has tensor entries alone."""
    path = _ckpt(tmp_path)
    save(path, {"w": torch.ones(2), "step": 4, "name": "run", "rng": RngState.capture()})
    md = read_dcp_metadata(path)
    assert sorted(md.state_dict_metadata) == ["w"]
    assert json.loads((Path(path) / MANIFEST).read_text())["leaves"][0] == {
        "path": ["name"],
        "kind": "value",
        "value": {"str": "run"},
    }


# --------------------------------------------------------------------------- DCP interop


@no_dist_warning
def test_dcp_loads_a_pshard_checkpoint(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    w, b = torch.randn(4, 3, dtype=torch.float64), torch.arange(5)
    save(path, {"model": {"w": w, "layers": [b]}, "step": 2})
    target = {"model": {"w": torch.empty(4, 3, dtype=torch.float64), "layers": [torch.empty(5)]}}
    target["model"]["layers"][0] = torch.empty(5, dtype=torch.int64)
    dcp.load(target, storage_reader=dcp.FileSystemReader(path))
    assert torch.equal(target["model"]["w"], w) and torch.equal(target["model"]["layers"][0], b)
    flat = {"model.w": torch.empty(4, 3, dtype=torch.float64)}
    dcp.load(flat, checkpoint_id=path)
    assert torch.equal(flat["model.w"], w)


@no_dist_warning
def test_a_dcp_checkpoint_loads_without_unpickling(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    w = torch.randn(3, 2)
    dcp.save({"model": {"w": w}, "n": 3}, checkpoint_id=path)
    meta = load_metadata(path)
    assert meta == {"model": {"w": SavedTensor((3, 2), torch.float32)}, "n": SavedObject("n")}
    got = load(path, {"model.w": torch.empty(3, 2)}, partial=True)
    assert torch.equal(got["model.w"], w)
    assert torch.equal(
        load(path, {"model": {"w": torch.empty(3, 2)}}, partial=True)["model"]["w"], w
    )
    with pytest.raises(ValueError, match=re.escape("'n' is a pickled Python object DCP wrote")):
        load(path, meta)
    with pytest.raises(
        ValueError,
        match=re.escape("like['n'] ('n'): the checkpoint holds a pickled object, like an int"),
    ):
        load(path, {"model": {"w": torch.empty(3, 2)}, "n": 0})


class _Evil:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch pwned",))


def test_metadata_unpickler_refuses_other_classes(tmp_path: Path, monkeypatch: Any) -> None:
    path = _ckpt(tmp_path)
    save(path, {"w": torch.ones(2)})
    (Path(path) / ".metadata").write_bytes(pickle.dumps(_Evil()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError, match=re.escape("names posix.system, which is")):
        load(path, {"w": torch.ones(2)})
    assert not (tmp_path / "pwned").exists()


# --------------------------------------------------------------------------- the atomic switch


def test_path_never_missing_while_saves_switch(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    save(path, {"i": torch.zeros(64)})
    stop, seen, missing = threading.Event(), [], []

    def poll() -> None:
        while not stop.is_set():
            if not (os.path.isdir(path) and os.path.exists(os.path.join(path, ".metadata"))):
                missing.append(1)
            else:
                seen.append(1)

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for i in range(1, 13):
            save(path, {"i": torch.full((64,), float(i))})
    finally:
        stop.set()
        reader.join()
    assert not missing and seen
    assert torch.equal(load(path, {"i": torch.zeros(64)})["i"], torch.full((64,), 12.0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and not os.path.islink(path)


def test_symlink_switch_where_directories_cannot_be_exchanged(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    path = _ckpt(tmp_path)
    save(path, {"i": 1})
    first = os.readlink(path)
    assert re.fullmatch(r"\.ckpt\.pshard-[0-9a-f]{32}", first)
    save(path, {"i": 2})
    assert os.readlink(path) != first and sorted(os.listdir(tmp_path)) == sorted(
        ["ckpt", os.readlink(path)]
    )
    assert load(path, {"i": 0}) == {"i": 2}
    assert dcp.FileSystemReader(path).read_metadata().state_dict_metadata == {}
    # a real directory cannot be switched without an exchange: refused, nothing changed
    real = tmp_path / "real"
    monkeypatch.undo()
    save(real, {"i": 3})
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    with pytest.raises(OSError, match=re.escape("cannot swap two directories in one step")):
        save(real, {"i": 4})
    assert load(real, {"i": 0}) == {"i": 3}


@no_dist_warning
def test_replaces_a_dcp_directory_and_removes_stale_asides(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    dcp.save({"w": torch.ones(2)}, checkpoint_id=path)
    stale = tmp_path / f".ckpt.pshard-{'a' * 32}"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half")
    kept = [tmp_path / f".ckpt.b.pshard-{'b' * 32}", tmp_path / ".ckpt.pshard-x"]
    for k in kept:
        k.mkdir()
    save(path, {"w": torch.zeros(2)})
    assert not stale.exists() and all(k.exists() for k in kept)
    assert torch.equal(load(path, {"w": torch.ones(2)})["w"], torch.zeros(2))


def test_refuses_to_replace_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match=re.escape("is a directory that holds no checkpoint")):
        save(tmp_path / "data", {"w": torch.ones(1)})
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=re.escape("exists and is not a directory")):
        save(tmp_path / "file", {"w": torch.ones(1)})
    assert (tmp_path / "data" / "notes.txt").read_text() == "keep"
    (tmp_path / "empty").mkdir()
    save(tmp_path / "empty", {"w": torch.ones(1)})


def _foreign(path: str | Path, names: str, checkpoint: bool) -> str:
    head = (
        "holds a checkpoint and"
        if checkpoint
        else "is a directory that holds no checkpoint (no .metadata DCP wrote) and"
    )
    return (
        f"save: {str(path)!r} {head} entries pshard did not write: {names}; a save replaces the "
        f"whole directory and would delete them, so pshard writes only over an empty directory "
        f"or a checkpoint it or DCP wrote: save into a fresh directory or a subdirectory, or "
        f"move them away"
    )


@no_dist_warning
def test_never_deletes_what_pshard_did_not_write(tmp_path: Path, monkeypatch: Any) -> None:
    path = Path(_ckpt(tmp_path))
    save(path, {"w": torch.ones(2)})
    (path / "config.json").write_text("{}")
    (path / "logs").mkdir()
    (path / "logs" / "train.log").write_text("...")
    with pytest.raises(ValueError, match=re.escape(_foreign(path, "'config.json', 'logs/'", True))):
        save(path, {"w": torch.zeros(2)})
    assert sorted(os.listdir(path)) == [
        ".metadata",
        "__0_0.distcp",
        "config.json",
        "logs",
        "pshard.json",
    ]
    assert (path / "logs" / "train.log").read_text() == "..."
    assert torch.equal(load(path, {"w": torch.empty(2)})["w"], torch.ones(2))
    # a file named .metadata that DCP did not write is no checkpoint
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".metadata").write_text("not DCP")
    (mine / "thesis.tex").write_text("...")
    with pytest.raises(
        ValueError, match=re.escape(_foreign(mine, "'.metadata', 'thesis.tex'", False))
    ):
        save(mine, {"w": torch.ones(2)})
    (mine / "thesis.tex").unlink()
    with pytest.raises(ValueError, match=re.escape(_foreign(mine, "'.metadata'", False))):
        save(mine, {"w": torch.ones(2)})
    assert (mine / ".metadata").read_text() == "not DCP"
    # a pshard.json that is not pshard's manifest, a directory named like DCP's files
    other = tmp_path / "other"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=other)
    (other / "pshard.json").write_text("{}")
    (other / "__9_0.distcp").mkdir()
    names = "'__9_0.distcp/', 'pshard.json'"
    with pytest.raises(ValueError, match=re.escape(_foreign(other, names, True))):
        save(other, {"w": torch.ones(2)})
    assert (other / "pshard.json").read_text() == "{}"
    # a subdirectory of a directory with other files is fine, and leaves them
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    save(run / "ckpt", {"w": torch.ones(2)})
    save(run / "ckpt", {"w": torch.zeros(2)})
    assert sorted(os.listdir(run)) == ["ckpt", "config.json"]
    # a file that appears while the ranks write is found before the switch
    import pshard._state.save as save_module

    real = save_module.write_checkpoint

    def meanwhile(*args: Any) -> None:
        (path.parent / "ckpt2" / "notes.txt").write_text("keep")
        real(*args)

    save(path.parent / "ckpt2", {"w": torch.ones(2)})
    monkeypatch.setattr(save_module, "write_checkpoint", meanwhile)
    with pytest.raises(
        ValueError, match=re.escape(_foreign(path.parent / "ckpt2", "'notes.txt'", True))
    ):
        save(path.parent / "ckpt2", {"w": torch.zeros(2)})
    monkeypatch.undo()
    assert (path.parent / "ckpt2" / "notes.txt").read_text() == "keep"
    assert torch.equal(load(path.parent / "ckpt2", {"w": torch.empty(2)})["w"], torch.ones(2))


def test_stale_asides_lose_only_what_pshard_wrote(tmp_path: Path) -> None:
    path = Path(_ckpt(tmp_path))
    stale = tmp_path / f".ckpt.pshard-{'a' * 32}"
    stale.mkdir()
    for name in (".metadata", ".metadata.tmp", "__0_0.distcp", "pshard.json"):
        (stale / name).write_bytes(b"half")
    (stale / "mine.txt").write_text("keep")
    save(path, {"w": torch.ones(2)})
    assert sorted(os.listdir(stale)) == ["mine.txt"]
    (stale / "mine.txt").unlink()
    save(path, {"w": torch.ones(2)})
    assert not stale.exists()


# --------------------------------------------------------------------------- async


def test_async_save_keeps_the_values_at_the_call(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    t = torch.zeros(1 << 16)
    futures = []
    for step in range(3):
        fut = save(path, {"t": t, "step": step}, async_save=True)
        assert isinstance(fut, Future)
        futures.append(fut)
        t.add_(1)  # in place, right after the call
    for fut in futures:
        assert fut.result(timeout=60) is None
    back = load(path, {"t": torch.empty(1 << 16), "step": 0})
    assert back["step"] == 2 and torch.equal(back["t"], torch.full((1 << 16,), 2.0))


def test_async_save_failure_is_in_the_future(tmp_path: Path, monkeypatch: Any) -> None:
    import pshard._state.write as write

    def broken(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError("disk full")

    path = _ckpt(tmp_path)
    save(path, {"t": torch.ones(3)})
    monkeypatch.setattr(write.DCPWriter, "write_data", broken)
    fut = save(path, {"t": torch.zeros(3)}, async_save=True)
    assert fut is not None
    with pytest.raises(OSError, match="disk full"):
        fut.result(timeout=60)
    monkeypatch.undo()
    assert torch.equal(load(path, {"t": torch.empty(3)})["t"], torch.ones(3))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name", ["save", "load", "load_metadata", "RngState"])
def test_docstring_examples_use_the_public_names(name: str) -> None:
    doc = getattr(ps, name).__doc__
    example = doc[doc.index("Example:") :]
    assert "pshard._" not in example and "pshard as ps" in example
    assert f"ps.{name}" in example


def _noop() -> None:
    pass


class _Color(enum.IntEnum):
    RED = 1


def test_save_errors_name_the_key_path(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    with pytest.raises(
        TypeError,
        match=re.escape(
            "save tree['opt']['fn']: a function; a checkpoint holds GlobalTensors, tensors, int, "
            "float, str, bool, None and ps.RngState (plain data, never a pickle): convert it to "
            "those (a dict of them for an object's state)"
        ),
    ):
        save(path, {"opt": {"fn": _noop}})
    with pytest.raises(TypeError, match=re.escape("save tree['c']: a _Color (<_Color.RED: 1>)")):
        save(path, {"c": _Color.RED})
    with pytest.raises(TypeError, match=re.escape("convert it with int(x)")):
        save(path, {"c": _Color.RED})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "save: tree['a']['b'] and tree['a.b'] have the same DCP key 'a.b' (DCP joins keys "
            "with '.'); rename one"
        ),
    ):
        save(path, {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})
    with pytest.raises(TypeError, match=re.escape("the key (1, 2) is tuple")):
        save(path, {(1, 2): torch.ones(1)})
    assert not os.path.exists(path)


def test_save_refuses_a_block_that_does_not_fit_its_layout(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    ps.init_mesh({"dp": 1})
    w = ps.shard(torch.arange(15.0).reshape(5, 3), ps.P("dp"))
    bad = optree.tree_map(lambda t: t[:2], w)  # a tree_map that changes the block's shape
    with pytest.raises(
        ValueError,
        match=re.escape(
            "save tree['opt']['w']: the GlobalTensor's block has shape (2, 3), but its spec "
            "P('dp', None) and global shape (5, 3) give this rank (dp=0) of mesh {'dp': 1} a "
            "block of shape (5, 3), so the checkpoint would not load; save GlobalTensors whose "
            "blocks fit their layout (ps.from_local(block, spec, global_shapes=...) checks it)"
        ),
    ):
        save(path, {"opt": {"w": bad}})
    flat = optree.tree_map(lambda t: t.reshape(-1), w)
    with pytest.raises(ValueError, match=re.escape("block has shape (15,), but its spec")):
        save(path, {"w": flat})
    assert not os.path.exists(path)


def test_load_errors_list_every_key(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    save(path, {"w": torch.ones(3, 2), "b": torch.ones(2), "step": 1, "opt": {"m": torch.ones(2)}})
    like = {
        "w": torch.ones(3, 4),
        "b": torch.ones(2, dtype=torch.float64),
        "step": "1",
        "extra": torch.ones(1),
    }
    with pytest.raises(ValueError) as info:
        load(path, like)
    assert str(info.value) == (
        f"load: like does not match the checkpoint at {path!r} (keys: key paths joined by '.')\n"
        "  missing from the checkpoint: like['extra'] ('extra')\n"
        "  in the checkpoint but not in like: 'opt.m' (pass partial=True to leave them unread)\n"
        "  different:\n"
        "    like['b'] ('b'): the checkpoint holds a float32 tensor of shape (2,), like a "
        "float64 tensor of shape (2,)\n"
        "    like['step'] ('step'): the checkpoint holds int 1, like a str\n"
        "    like['w'] ('w'): the checkpoint holds a float32 tensor of shape (3, 2), like a "
        "float32 tensor of shape (3, 4)"
    )
    ok = load(path, {"w": torch.ones(3, 2), "step": 0}, partial=True)
    assert ok["step"] == 1
    with pytest.raises(FileNotFoundError, match=re.escape("load: no checkpoint at")):
        load(tmp_path / "nothing", {})
    with pytest.raises(TypeError, match=re.escape("load like['f']: a function; like holds")):
        load(path, {"f": _noop}, partial=True)


def test_saved_tensor_with_a_spec_needs_a_mesh(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    save(path, {"w": torch.ones(2)})
    entry = dataclasses.replace(load_metadata(path)["w"], spec=ps.P("dp"))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "load like['w']: a SavedTensor with spec P('dp') asks for a GlobalTensor on the "
            "current mesh, but there is none"
        ),
    ):
        contextvars.Context().run(load, path, {"w": entry})
    meta_like = {"w": torch.empty(2, device="meta")}
    assert load(path, meta_like)["w"].device == torch.device("cpu")


def test_a_process_without_a_process_group(tmp_path: Path, monkeypatch: Any) -> None:
    """Saves run their steps alone (no object collectives) when there is no process group."""
    import pshard._state.save as save_module
    from pshard._state.comm import LocalComm

    monkeypatch.setattr(save_module, "default_comm", LocalComm)
    path = _ckpt(tmp_path)
    save(path, {"t": torch.arange(3.0), "step": 1})
    fut = save(path, {"t": torch.arange(4.0), "step": 2}, async_save=True)
    assert fut is not None and fut.result(timeout=60) is None
    back = load(path, {"t": torch.empty(4), "step": 0})
    assert back["step"] == 2 and torch.equal(back["t"], torch.arange(4.0))
