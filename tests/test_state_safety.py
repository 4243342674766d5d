"""Checkpoints under an unlucky or careless user, on one process: a load that a save of the
same path overlaps returns one whole checkpoint (a save switching the path between the load's
metadata read and its tensor reads, in both switch modes, and a stress loop with saving
processes), every chunk's checksum verified (a flipped byte, a truncated file, a missing
file, each named), a checkpoint without its manifest, a read-only parent directory, and an
async save that nobody waits on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pshard._state.atomic as atomic
import pshard._state.read as read_mod
from pshard._state.load import load, load_metadata
from pshard._state.manifest import MANIFEST
from pshard._state.reader import CheckpointReader, read_dcp_metadata
from pshard._state.save import save


def _ckpt(tmp_path: Path) -> str:
    return str(tmp_path / "ckpt")


def _state(i: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(i)), "b": torch.full((3,), float(i)), "step": i}


def _like() -> dict[str, Any]:
    return {"w": torch.empty(256), "b": torch.empty(3), "step": 0}


def _whole(back: dict[str, Any]) -> int:
    """The step of the checkpoint ``back`` came from; fails on a mix of two."""
    step = back["step"]
    assert torch.equal(back["w"], torch.full((256,), float(step))), (step, back["w"][:4])
    assert torch.equal(back["b"], torch.full((3,), float(step))), (step, back["b"])
    return int(step)


# --------------------------------------------------------------------------- a save mid-load


@pytest.mark.parametrize("when", ["before_files", "files_open"])
@pytest.mark.parametrize("mode", ["exchange", "symlink"])
def test_a_save_switching_mid_load_gives_one_checkpoint(
    tmp_path: Path, monkeypatch: Any, mode: str, when: str
) -> None:
    """The load has read the manifest and DCP's metadata of step 1 when a save of step 2
    switches the path: it returns one whole checkpoint (never step 1's plain values with step
    2's tensors): step 2 when the switch comes before the load opened the data files (step
    1's are deleted: it opens the path again), step 1 once they are open; the next load
    step 2."""
    if mode == "symlink":
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    path = _ckpt(tmp_path)
    save(path, _state(1))
    owner, name = (read_mod, "_plan") if when == "before_files" else (CheckpointReader, "read_data")
    original = getattr(owner, name)
    saved: list[int] = []

    def switching(*args: Any, **kwargs: Any) -> Any:
        if not saved:
            saved.append(2)
            save(path, _state(2))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, switching)
    assert _whole(load(path, _like())) == (2 if when == "before_files" else 1)
    assert saved and _whole(load(path, _like())) == 2


def test_a_load_that_opens_a_checkpoint_being_deleted_reads_the_next(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The load opens step 1's directory just as a save of step 2 has switched the path and is
    deleting step 1's files: the manifest is gone, DCP's metadata not yet. That is the next
    checkpoint arriving, not a damaged one: the load opens the path again and returns step 2
    (it said "the checkpoint ... is damaged: ... its manifest pshard.json ... is missing")."""
    from pshard._state.opened import OpenedCheckpoint

    path = _ckpt(tmp_path)
    save(path, _state(1))
    exists, remove = OpenedCheckpoint.exists, atomic._remove
    saved: list[int] = []

    def manifest_only(entry: Path) -> None:  # the deletion caught after its first file
        (entry / MANIFEST).unlink()

    def switching(self: OpenedCheckpoint, name: str) -> bool:
        if not saved:
            saved.append(2)
            monkeypatch.setattr(atomic, "_remove", manifest_only)
            save(path, _state(2))
            monkeypatch.setattr(atomic, "_remove", remove)
        return exists(self, name)

    monkeypatch.setattr(OpenedCheckpoint, "exists", switching)
    assert _whole(load(path, _like())) == 2
    assert saved


def test_loads_beside_a_saving_thread_each_get_one_checkpoint(tmp_path: Path) -> None:
    """A stress loop: loads in a loop while another thread saves step after step into the
    same path; every load is one whole checkpoint, and the steps seen only go up."""
    path = _ckpt(tmp_path)
    save(path, _state(0))
    stop = threading.Event()
    errors: list[BaseException] = []

    def saving() -> None:
        i = 1
        try:
            while not stop.is_set():
                save(path, _state(i))
                i += 1
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=saving)
    thread.start()
    steps = []
    try:
        for _ in range(150):
            steps.append(_whole(load(path, _like())))
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert steps == sorted(steps) and steps[-1] > steps[0], steps


# --------------------------------------------------------------------------- checksums


def _stored(path: str, key: str) -> tuple[Path, int, int]:
    """The file, offset and length of ``key``'s (one) saved chunk."""
    md = read_dcp_metadata(path)
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == key]
    return Path(path) / info.relative_path, int(info.offset), int(info.length)


def _damage(tmp_path: Path) -> tuple[str, Path, int, int]:
    """A checkpoint with 4 bytes in the middle of ``w``'s chunk flipped."""
    path = _ckpt(tmp_path)
    save(path, _state(1))
    file, start, length = _stored(path, "w")
    data = bytearray(file.read_bytes())
    middle = start + length // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    file.write_bytes(bytes(data))
    return path, file, start, length


def test_a_changed_byte_is_an_error_naming_file_key_and_checkpoint(tmp_path: Path) -> None:
    path, file, start, length = _damage(tmp_path)
    with pytest.raises(ValueError) as info:
        load(path, _like())
    text = str(info.value)
    assert text.startswith(
        f"load: the checkpoint at {path!r} is damaged: key 'w' (its chunk at offsets (0,)) is "
        f"stored in file {file.name!r} at bytes {start}..{start + length}, but its checksum is "
    )
    assert text.endswith(
        "so the bytes changed after the save; restore the file or load another checkpoint"
    )
    # verify=False reads what is there; the other keys were never wrong
    back = load(path, _like(), verify=False)
    assert torch.equal(back["b"], torch.full((3,), 1.0))


def test_a_truncated_file_is_an_error_naming_it(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    save(path, _state(1))
    file, start, length = _stored(path, "w")
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size // 2)
    for verify in (True, False):
        with pytest.raises(ValueError) as info:
            load(path, _like(), verify=verify)
        text = str(info.value)
        assert f"load: the checkpoint at {path!r} is damaged: key " in text
        assert re.search(
            rf"is stored in file {re.escape(repr(file.name))} at bytes \d+\.\.\d+, but the file "
            rf"has {size // 2} bytes, so it is truncated",
            text,
        ), text


def test_a_missing_data_file_is_named(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    save(path, _state(1))
    file, _, _ = _stored(path, "w")
    file.unlink()
    with pytest.raises(
        FileNotFoundError,
        match=re.escape(
            f"load: the checkpoint at {path!r} is damaged: its file {file.name!r}, which holds "
            f"keys 'b', 'w', is missing; restore it or load another checkpoint"
        ),
    ):
        load(path, _like())


@pytest.mark.parametrize("checksum", ["crc32c", "crc32"])
def test_every_chunk_has_its_checksum_in_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checksum: str
) -> None:
    """One checksum per chunk DCP stored, of the bytes it stored: CRC-32C where the crc32c
    package computes it in hardware, else zlib's CRC-32 (a process without the package, and
    the checkpoints saved before CRC-32C: both load and are verified)."""
    crc32c = pytest.importorskip("crc32c")
    import pshard._state.checksums as checksums

    if checksum == "crc32":  # a process without the package
        monkeypatch.setattr(checksums, "_crc32c", lambda: None)
    path = _ckpt(tmp_path)
    save(path, _state(3))
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    assert manifest["checksum"] == checksum
    md = read_dcp_metadata(path)
    want = {}
    of = zlib.crc32 if checksum == "crc32" else crc32c.crc32c
    for index, info in md.storage_data.items():
        data = (Path(path) / info.relative_path).read_bytes()[
            info.offset : info.offset + info.length
        ]
        want[(index.fqn, tuple(index.offset))] = f"{of(data):08x}"
    assert {(k, tuple(o)): c for k, o, c in manifest["chunks"]} == want
    assert manifest["save_id"] == md.storage_meta.save_id
    monkeypatch.undo()
    assert torch.equal(load(path, _like())["b"], torch.full((3,), 3.0))  # verified either way


def test_a_crc32c_checkpoint_without_the_package_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("crc32c")
    import pshard._state.checksums as checksums

    path = _ckpt(tmp_path)
    save(path, _state(2))
    monkeypatch.setattr(checksums, "_crc32c", lambda: None)
    with pytest.raises(ValueError, match=re.escape("install the 'crc32c' package")):
        load(path, _like())
    assert torch.equal(load(path, _like(), verify=False)["b"], torch.full((3,), 2.0))


# --------------------------------------------------------------------------- what is missing


def test_a_checkpoint_without_its_manifest_says_so(tmp_path: Path) -> None:
    path = _ckpt(tmp_path)
    save(path, _state(1))
    (Path(path) / MANIFEST).unlink()
    md = read_dcp_metadata(path)
    want = re.escape(
        f"the checkpoint at {path!r} is damaged: pshard wrote it (DCP's .metadata names save "
        f"{md.storage_meta.save_id!r}) but its manifest pshard.json, which holds the tree's "
        f"structure, layouts, plain values and checksums, is missing; restore it or load "
        f"another checkpoint (torch.distributed.checkpoint.load still reads its tensors)"
    )
    with pytest.raises(FileNotFoundError, match="load: " + want):
        load(path, _like())
    with pytest.raises(FileNotFoundError, match="load_metadata: " + want):
        load_metadata(path)


@contextlib.contextmanager
def _read_only(directory: Path) -> Iterator[None]:
    """``directory`` read-only for this process: its mode for a user, immutable (``chattr
    +i``) for root, whose rights ignore the mode."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: no directory is read-only here")
    made = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"running as root where chattr +i fails ({made.stderr.strip()!r})")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_a_read_only_parent_directory_is_named(tmp_path: Path) -> None:
    parent = tmp_path / "runs"
    parent.mkdir()
    path = str(parent / "ckpt")
    with _read_only(parent), pytest.raises(PermissionError) as info:
        save(path, _state(1))
    assert str(info.value) == (
        f"[Errno 13] save: cannot write a checkpoint at {path!r}: this process may not create "
        f"files in its directory {str(parent)!r} (a save writes the checkpoint beside the path, "
        f"as '.ckpt.pshard-<id>', then renames it to the path); make that directory writable, "
        f"or save elsewhere"
    )
    assert os.listdir(parent) == []
