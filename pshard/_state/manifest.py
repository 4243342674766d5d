"""What a checkpoint holds, as plain data: the tree's structure and one record per leaf.

DCP's files hold the tensors; beside them ``pshard.json`` (the *manifest*) holds what DCP does
not: the tree's structure (dicts, lists, tuples, ``None``; other containers as dicts of their
fields), each leaf's key path, and per leaf either a tensor's global shape, dtype and layout
(spec and mesh axes) or the value itself (ints, floats, strings, bools, ``None``, RNG states as
base64 text), the save's id (which DCP's metadata names too) and the CRC-32 of every chunk DCP
stored. Nothing is pickled.

A leaf's DCP key (its *fqn*) is its key path joined by ``"."``, as DCP names the entries of a
nested state dict: ``{"model": {"w": x}}`` -> ``"model.w"``, ``{"layers": [a, b]}`` ->
``"layers.0"``, ``"layers.1"``. :func:`pshard.load` matches a tree to a checkpoint by these
keys, so a flat ``model.state_dict()`` and the same tensors nested by module name match.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, cast

import optree
import torch
from optree import PyTreeAccessor, PyTreeKind, PyTreeSpec

from .._core.placements import P
from .._core.tree import keystr
from .checksums import ALGORITHMS, CRC32
from .rng import RngState

__all__ = [
    "FORMAT",
    "MANIFEST",
    "SAVE_ID_PREFIX",
    "VERSION",
    "ChunkSum",
    "KeyPath",
    "LeafKind",
    "LeafRecord",
    "Manifest",
    "SavedObject",
    "SavedTensor",
    "build_tree",
    "dtype_from_name",
    "dtype_name",
    "encode_structure",
    "fqn",
    "key_path",
    "save_id",
    "spec_from_json",
    "spec_to_json",
    "value_from_json",
    "value_to_json",
    "where",
]

MANIFEST = "pshard.json"
FORMAT = "pshard-checkpoint"
VERSION = 1

KeyPath = tuple[str | int, ...]
LeafKind = Literal["global", "tensor", "value", "none", "rng", "object"]


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """A tensor leaf of a checkpoint, as :func:`pshard.load_metadata` describes it.

    As a leaf of the ``like`` tree of :func:`pshard.load` it asks for that tensor: whole on every
    rank when ``spec`` is ``None``, else a :class:`~pshard.GlobalTensor` with ``spec`` on the
    current mesh (:func:`pshard.current_mesh`). ``load_metadata`` gives the layout the tensor
    was saved with; ``dataclasses.replace(entry, spec=None)`` asks for the whole tensor,
    ``dataclasses.replace(entry, spec=ps.P(None, "tp"))`` for another layout.

    Attributes:
        shape: the global shape.
        dtype: the dtype.
        spec: the layout (a :class:`~pshard.P` over mesh axes), or ``None``: a whole tensor.
        mesh: the axes of the mesh it was saved on (name -> size), or ``None`` (a whole tensor,
            or a checkpoint not written by pshard).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: P | None = None
    mesh: tuple[tuple[str, int], ...] | None = None


@dataclasses.dataclass(frozen=True)
class SavedObject:
    """An entry DCP wrote as a pickled Python object (``dcp.save`` of a value that is not a
    tensor). pshard never unpickles: :func:`pshard.load` refuses to read it."""

    fqn: str


@dataclasses.dataclass(frozen=True)
class LeafRecord:
    """One leaf of the manifest.

    ``kind``: ``"global"`` (a :class:`~pshard.GlobalTensor`: ``shape``, ``dtype``, ``spec``,
    ``mesh``), ``"tensor"`` (a whole tensor: ``shape``, ``dtype``), ``"value"`` (an int, float,
    str or bool: ``value``), ``"none"``, ``"rng"`` (``rng``: one :class:`RngState` per saving
    rank) or ``"object"`` (an entry of a checkpoint DCP wrote as a pickle; never in a manifest).
    """

    path: KeyPath
    kind: LeafKind
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    spec: P | None = None
    mesh: tuple[tuple[str, int], ...] | None = None
    value: Any = None
    rng: tuple[RngState, ...] = ()

    @property
    def fqn(self) -> str:
        return fqn(self.path)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": list(self.path), "kind": self.kind}
        if self.kind in ("global", "tensor"):
            assert self.dtype is not None
            out["shape"] = list(self.shape)
            out["dtype"] = dtype_name(self.dtype)
        if self.kind == "global":
            assert self.spec is not None and self.mesh is not None
            out["spec"] = spec_to_json(self.spec)
            out["mesh"] = [[n, s] for n, s in self.mesh]
        if self.kind == "value":
            out["value"] = value_to_json(self.value)
        if self.kind == "rng":
            out["states"] = [s.to_json() for s in self.rng]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LeafRecord:
        path = tuple(data["path"])
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
            raise ValueError(f"a key path holds keys other than str and int: {path!r}")
        kind = data["kind"]
        if kind in ("global", "tensor"):
            shape = tuple(int(n) for n in data["shape"])
            dtype = dtype_from_name(data["dtype"])
            if kind == "tensor":
                return cls(path, "tensor", shape, dtype)
            mesh = tuple((str(n), int(s)) for n, s in data["mesh"])
            return cls(path, "global", shape, dtype, spec_from_json(data["spec"]), mesh)
        if kind == "value":
            return cls(path, "value", value=value_from_json(data["value"]))
        if kind == "none":
            return cls(path, "none")
        if kind == "rng":
            return cls(path, "rng", rng=tuple(RngState.from_json(s) for s in data["states"]))
        raise ValueError(f"unknown leaf kind {kind!r}")

    def entry(self, rank: int, world: int, source: str) -> Any:
        """What :func:`pshard.load_metadata` shows for this leaf on ``rank`` of ``world``."""
        if self.kind == "global":
            assert self.dtype is not None
            return SavedTensor(self.shape, self.dtype, self.spec, self.mesh)
        if self.kind == "tensor":
            assert self.dtype is not None
            return SavedTensor(self.shape, self.dtype)
        if self.kind == "value":
            return self.value
        if self.kind == "none":
            return None
        if self.kind == "object":
            return SavedObject(self.fqn)
        try:
            return self.rng_for(rank, world, f"{source} {where(self.path)}")
        except ValueError:  # load refuses it; the metadata shows rank 0's
            return self.rng[0]

    def rng_for(self, rank: int, world: int, here: str) -> RngState:
        """The RNG state rank ``rank`` of a world of ``world`` ranks takes: the one it saved on
        the same world size, or the one every rank saved. ``here`` names the caller and the
        leaf in errors (``load like['rng']``).

        Raises:
            ValueError: the ranks saved different states and the world size changed.
        """
        states = self.rng
        if len(states) == world:
            return states[rank]
        if all(s == states[0] for s in states):
            return states[0]
        raise ValueError(
            f"{here}: the {len(states)} saving ranks held different RNG states and this world "
            f"has {world} ranks, so no rank's state is the one to take; load on {len(states)} "
            f"ranks, save one state that every rank shares, or leave this key out "
            f"(ps.load(path, like, partial=True))"
        )


#: A saved chunk's checksum: its DCP key, its offsets in the global tensor and the checksum
#: (:mod:`pshard._state.checksums`) of the bytes DCP stored for it (its ``torch.save`` record in
#: the rank's ``.distcp`` file).
ChunkSum = tuple[str, tuple[int, ...], int]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The manifest of a checkpoint: the world size it was saved on, the tree's structure
    (:func:`encode_structure`), the leaves in flatten order, the save's id (also in DCP's
    metadata: the two files come from one save) and every saved chunk's checksum.

    ``save_id`` is ``None`` and ``sums`` empty in checkpoints written before pshard recorded
    them (they load unverified)."""

    world_size: int
    structure: Any
    leaves: tuple[LeafRecord, ...]
    save_id: str | None = None
    sums: tuple[ChunkSum, ...] = ()
    checksum: str = CRC32  # what ``sums`` hold (pshard._state.checksums)

    def to_json(self) -> str:
        """The manifest as JSON text: one line per field, one per leaf and one per chunk."""
        head: dict[str, Any] = {"format": FORMAT, "version": VERSION, "world_size": self.world_size}
        if self.save_id is not None:
            head["save_id"] = self.save_id
        lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in head.items()]
        lines.append(f'"tree": {json.dumps(self.structure, allow_nan=False)}')
        leaves = ",\n  ".join(json.dumps(leaf.to_json(), allow_nan=False) for leaf in self.leaves)
        lines.append(f'"leaves": [\n  {leaves}\n ]' if self.leaves else '"leaves": []')
        if self.sums:
            lines.append(f'"checksum": {json.dumps(self.checksum)}')
            chunks = ",\n  ".join(
                json.dumps([key, list(offsets), f"{crc:08x}"]) for key, offsets, crc in self.sums
            )
            lines.append(f'"chunks": [\n  {chunks}\n ]')
        return "{\n " + ",\n ".join(lines) + "\n}\n"

    def checksums(self) -> dict[tuple[str, tuple[int, ...]], int]:
        """``(key, chunk offsets) -> checksum`` of every saved chunk (:attr:`checksum`)."""
        return {(key, offsets): crc for key, offsets, crc in self.sums}

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        """Parse a manifest.

        Raises:
            ValueError: not a manifest pshard can read (the message names ``source``).
        """
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
            if data.get("version") != VERSION:
                raise ValueError(
                    f"version {data.get('version')!r}; this pshard reads version {VERSION}"
                )
            leaves = tuple(LeafRecord.from_json(leaf) for leaf in data["leaves"])
            save_id = data.get("save_id")
            if save_id is not None and not isinstance(save_id, str):
                raise ValueError(f"save_id {save_id!r} is not a str")
            sums: tuple[ChunkSum, ...] = ()
            checksum = data.get("checksum", CRC32)
            if "chunks" in data:
                if checksum not in ALGORITHMS:
                    raise ValueError(
                        f"checksum {checksum!r}; this pshard checks {' or '.join(ALGORITHMS)}"
                    )
                sums = tuple(
                    (str(key), tuple(int(i) for i in offsets), int(crc, 16))
                    for key, offsets, crc in data["chunks"]
                )
            return cls(int(data["world_size"]), data["tree"], leaves, save_id, sums, checksum)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source}: not a pshard manifest ({type(e).__name__}: {e})") from None


def save_id(token: str) -> str:
    """The id a save names in DCP's metadata and in its manifest (``pshard-<token>``)."""
    return f"{SAVE_ID_PREFIX}{token}"


#: How the save ids pshard writes into DCP's metadata begin.
SAVE_ID_PREFIX = "pshard-"


# --------------------------------------------------------------------------- keys


def key_path(accessor: PyTreeAccessor, fn: str) -> KeyPath:
    """The key path of a leaf: mapping keys (str or int), sequence indices and field names.

    Raises:
        TypeError: a mapping key that is neither a str nor an int.
    """
    out: list[str | int] = []
    for entry in accessor:
        key: Any = entry.entry
        if isinstance(entry, (optree.NamedTupleEntry, optree.StructSequenceEntry)):
            key = entry.field
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(
                f"{fn} {keystr(accessor, 'tree')}: the key {key!r} is {type(key).__name__}; a "
                f"checkpoint names its entries by str and int keys (DCP joins them with '.'), "
                f"so use str keys"
            )
        out.append(key)
    return tuple(out)


def fqn(path: KeyPath) -> str:
    """DCP's name for a leaf: its keys joined by ``"."``."""
    return ".".join(map(str, path))


def where(path: KeyPath) -> str:
    """A key path for messages: ``tree['params']['w1']``."""
    return keystr(path, "tree")


# --------------------------------------------------------------------------- structure


def _children_keys(spec: PyTreeSpec) -> list[str | int]:
    kind = spec.kind
    if kind in (PyTreeKind.LIST, PyTreeKind.TUPLE, PyTreeKind.DEQUE):
        return list(range(spec.num_children))
    if kind == PyTreeKind.NAMEDTUPLE:
        return list(optree.namedtuple_fields(cast("type[tuple[Any, ...]]", spec.type)))
    if kind == PyTreeKind.STRUCTSEQUENCE:
        return list(optree.structseq_fields(cast("type[tuple[Any, ...]]", spec.type)))
    return list(spec.entries())


def encode_structure(spec: PyTreeSpec, fn: str) -> Any:
    """The structure of ``spec`` as JSON: a leaf is its index in flatten order, a list or tuple
    ``{"list": [...]}`` / ``{"tuple": [...]}``, anything else with keys (dicts, namedtuples,
    dataclasses, Mappings) ``{"dict": [[key, child], ...], "type": "module.Name"}``.

    Raises:
        TypeError: a key that is neither a str nor an int.
    """
    counter = iter(range(spec.num_leaves))

    def encode(s: PyTreeSpec) -> Any:
        if s.is_leaf():
            return next(counter)
        children = [encode(c) for c in s.children()]
        if s.kind in (PyTreeKind.LIST, PyTreeKind.DEQUE):
            return {"list": children}
        if s.kind == PyTreeKind.TUPLE:
            return {"tuple": children}
        keys = _children_keys(s)
        for key in keys:
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(
                    f"{fn}: a {s.type.__name__ if s.type else 'node'} has the key {key!r}; a "
                    f"checkpoint names its entries by str and int keys"
                )
        name = f"{s.type.__module__}.{s.type.__qualname__}" if s.type is not None else "dict"
        return {"dict": [[k, c] for k, c in zip(keys, children, strict=True)], "type": name}

    return encode(spec)


def build_tree(structure: Any, leaves: Sequence[Any]) -> Any:
    """Rebuild a tree from :func:`encode_structure`'s JSON and its leaves (dicts for every
    node with keys, lists and tuples as they were).

    Raises:
        ValueError: the structure is not one :func:`encode_structure` writes.
    """
    if isinstance(structure, int) and not isinstance(structure, bool):
        return leaves[structure]
    if isinstance(structure, dict):
        if "list" in structure:
            return [build_tree(c, leaves) for c in structure["list"]]
        if "tuple" in structure:
            return tuple(build_tree(c, leaves) for c in structure["tuple"])
        if "dict" in structure:
            return {k: build_tree(c, leaves) for k, c in structure["dict"]}
    raise ValueError(f"not a saved tree structure: {structure!r}")


# --------------------------------------------------------------------------- plain data


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float64`` -> ``"float64"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float64"`` -> ``torch.float64``.

    Raises:
        ValueError: not a torch dtype.
    """
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def spec_to_json(spec: P) -> list[Any]:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_from_json(data: Sequence[Any]) -> P:
    return P(*(tuple(e) if isinstance(e, list) else e for e in data))


_NONFINITE = MappingProxyType({"nan": math.nan, "inf": math.inf, "-inf": -math.inf})


def value_to_json(value: int | float | str | bool) -> dict[str, Any]:
    """A plain value as JSON, its type kept (``True`` is not ``1``; non-finite floats as text)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"}
    return {type(value).__name__: value}


_PLAIN_TYPES: Mapping[str, type] = MappingProxyType(
    {"int": int, "float": float, "str": str, "bool": bool}
)


def value_from_json(data: Mapping[str, Any]) -> int | float | str | bool:
    """The inverse of :func:`value_to_json`.

    Raises:
        ValueError: not what :func:`value_to_json` writes.
    """
    ((name, raw),) = data.items()
    value: Any = raw
    if name == "float" and isinstance(value, str):
        return _NONFINITE[value]
    cls = _PLAIN_TYPES.get(name)
    if cls is None:
        raise ValueError(f"not a saved value: {data!r}")
    if cls is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not cls:
        raise ValueError(f"not a saved {name}: {value!r}")
    return cast("int | float | str | bool", value)
