"""The public functions of sharded checkpoints, light to import: ``torch.distributed.checkpoint``
(and DTensor with it) is imported by their first call, not by ``import pshard``."""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

from .._runtime.tracing import refuse

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["load", "load_metadata", "save"]

_NOT_GIVEN: Any = object()  # (None is a value a tree may hold)


def save(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    async_save: bool = False,
    format: Literal["dcp", "huggingface"] = "dcp",
    config: Any = None,
) -> Future[None] | None:
    """Save ``tree`` as a checkpoint at ``path`` (a directory), in
    ``torch.distributed.checkpoint``'s format. Every rank calls it, with the same tree.

    Each rank writes only its blocks of each :class:`~pshard.GlobalTensor` (a block several
    ranks hold, once); whole tensors are written once; ints, floats, strings, bools, ``None``
    and :class:`RngState` s (each rank's) are stored as JSON beside DCP's files, with the
    tree's structure and every tensor's global shape, dtype and spec (:func:`load_metadata`).
    DTensors are saved as the GlobalTensors of :func:`pshard.from_dtensor`.

    The checkpoint is written aside and switched in atomically once every rank has written:
    ``path`` holds the previous checkpoint until then (also if a rank dies half-way) and never
    stops existing. DCP's own tools read it: ``dcp.load(state_dict, checkpoint_id=path)``, keys
    being the key paths joined by ``"."`` (``{"model": {"w": x}}`` -> ``"model.w"``).

    ``format="huggingface"`` writes a model's weights as Hugging Face safetensors instead: a
    tree of tensors only, keyed by state-dict names (a flat ``{"model.embed_tokens.weight":
    ...}``, or nested dicts whose keys join to them), each rank writing its blocks and rank 0
    consolidating them into ``model-0000i-of-0000N.safetensors`` (up to 5 GB each) and
    ``model.safetensors.index.json`` (torch's ``HuggingFaceStorageWriter``), written aside and
    switched in the same way. With ``config=model.config`` the model's ``config.json`` is
    written with them, so ``AutoModelForCausalLM.from_pretrained(path)`` loads the directory
    alone; :func:`load` reads it back sharded.

    Args:
        path: the checkpoint directory: it must not exist, be empty, or hold a checkpoint
            and nothing else (which it replaces; files pshard and DCP did not write there,
            a ``config.json`` unless ``config`` is given, or ``logs/``, are never deleted:
            the save refuses them).
        tree: a pytree of GlobalTensors, tensors, DTensors, int, float, str, bool, ``None``
            and :class:`RngState`, with str (or int) keys.
        async_save: return at once with a ``concurrent.futures.Future`` while a background
            thread writes; what is saved is the tree at the call (its tensors are copied to
            CPU memory first). Saves into one parent directory switch in call order. The save
            finishes also if the caller returns without waiting (the process waits for it at
            exit; its exchanges need no process group).
        format: ``"dcp"`` (pshard's checkpoint) or ``"huggingface"`` (safetensors of a
            model's weights).
        config: with ``format="huggingface"``, the model's config (a Hugging Face
            ``PretrainedConfig``): written as ``config.json`` beside the weights (replacing
            one there).

    Returns:
        ``None``, or with ``async_save`` a ``Future`` whose ``result()`` is ``None`` once the
        checkpoint is in place and raises what the save raised.

    Raises:
        TypeError: a leaf a checkpoint cannot hold (the message names its key path; with
            ``format="huggingface"``, anything but a tensor of a dtype safetensors holds); a
            ``config`` no registered model family writes, or one with ``format="dcp"``.
        ValueError: two leaves with one DCP key, a GlobalTensor whose block does not fit its
            spec and global shape, ranks passing different trees (each difference named),
            copies of a whole tensor or of a replicated GlobalTensor's block that differ
            between the ranks holding them (the key path and the ranks named: per-rank state
            is a GlobalTensor, ``ps.from_local``), or ``path`` a file or a directory holding
            something pshard and DCP do not write (each such entry named).
        PermissionError: this process may not create files in ``path``'s directory.
        RuntimeError: another rank failed (nothing was switched).

    Example:
        >>> import tempfile, torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> state = {"w": ps.shard(torch.arange(6.0).reshape(3, 2), ps.P("dp")), "step": 3}
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> ps.save(path, state)
        >>> back = ps.load(path, state)
        >>> torch.equal(back["w"].local, state["w"].local), back["step"]
        (True, 3)
    """
    from .save import save as run  # torch.distributed.checkpoint, loaded at the first call

    refuse("ps.save", "it writes files (save the program's results after it runs)")
    return run(path, tree, async_save=async_save, format=format, config=config)


def load_metadata(path: str | os.PathLike[str]) -> Any:
    """The tree saved at ``path``, with a :class:`SavedTensor` (global shape, dtype, spec) for
    each tensor and the plain values themselves (ints, floats, strings, bools, ``None``,
    :class:`RngState` s: the state :func:`load` gives this rank, or rank 0's where the ranks
    saved different states and the world size changed, which ``load`` refuses).

    Containers come back as dicts (namedtuples, dataclasses and Mappings as dicts of their
    fields), lists and tuples. A checkpoint DCP wrote without pshard comes back as nested
    dicts of its entries (``SavedTensor`` with ``spec=None``; a pickled object as
    :class:`SavedObject`). A Hugging Face model directory (``model.safetensors``, or the
    files ``model.safetensors.index.json`` names) comes back as a flat dict keyed by
    state-dict names (``"model.embed_tokens.weight"``), each a ``SavedTensor`` with
    ``spec=None``. The tree is a valid ``like`` for :func:`load`.

    Raises:
        FileNotFoundError: no checkpoint at ``path``; a checkpoint pshard wrote without its
            manifest ``pshard.json``.
        ValueError: a damaged or inconsistent checkpoint (named).

    Example:
        >>> import tempfile, torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> ps.save(path, {"w": ps.shard(torch.ones(4, 2), ps.P("dp")), "lr": 0.1})
        >>> meta = ps.load_metadata(path)
        >>> meta["lr"], meta["w"].shape, meta["w"].dtype, meta["w"].spec
        (0.1, (4, 2), torch.float32, P('dp', None))
    """
    from .load import load_metadata as run  # torch.distributed.checkpoint, loaded at the first call

    refuse("ps.load_metadata", "it reads files")
    return run(path)


def load(
    path: str | os.PathLike[str],
    like: Any = _NOT_GIVEN,
    *,
    specs: Any = _NOT_GIVEN,
    mesh: DeviceMesh | None = None,
    partial: bool = False,
    verify: bool = True,
) -> Any:
    """Read the checkpoint at ``path`` into the layout of ``like``, or straight into the
    layouts ``specs`` gives (``ps.load(path, specs=ps.P("dp"))``).

    ``like`` is only read: its structure is the result's, and each leaf says what to read:

    - a :class:`~pshard.GlobalTensor`: a ``GlobalTensor`` with its spec and mesh (any layout:
      saved on 4 ranks as ``P("dp")``, read on 2 as ``P(None, "tp")``); a DTensor: a DTensor
      with its placements; a tensor: the whole tensor, on every rank. Blocks go to the device
      of ``like``'s (the mesh's device when that is ``meta``: a ``like`` of meta blocks
      allocates nothing twice);
    - a :class:`SavedTensor` (what :func:`load_metadata` returns): the whole tensor (on CPU)
      when its ``spec`` is ``None``, else a ``GlobalTensor`` with that spec on the current mesh;
    - an int, float, str or bool, ``None``, an :class:`RngState`: the saved value (each rank
      its own RNG state; with another world size, the state every rank saved).

    Leaves match the checkpoint's entries by key (key paths joined by ``"."``, DCP's names), so
    a checkpoint DCP wrote (an FSDP2 ``model.state_dict()``) reads into ``GlobalTensor`` s too,
    and so does a Hugging Face model directory (keys: state-dict names; read with torch's
    ``HuggingFaceStorageReader``, its files checked as long as their headers say; no
    checksums, which safetensors does not carry).
    Each rank reads only the saved chunks that overlap its blocks; no collective, except
    ``ps.reshard`` for a layout DTensor cannot express (uneven ``StridedShard``), read in its
    nearest expressible layout and then moved.

    ``specs`` (instead of ``like``) is a prefix tree of the saved tree (a single spec for every
    tensor, ``{"params": P("dp"), "step": None}``, the specs of ``ps.tensor_parallel_specs`` for
    a Hugging Face directory's flat dict): each tensor comes back as a ``GlobalTensor`` of its
    spec (``Replicate()`` for ``P()``), or whole where the spec is ``None``; the other values as
    saved. It is ``load(path, like)`` with ``like`` what :func:`load_metadata` gives, each
    entry's spec replaced.

    Args:
        path: a checkpoint directory, or a Hugging Face model directory.
        like: the tree to read into.
        specs: the layouts to read into (a prefix tree of the saved tree), instead of ``like``.
        mesh: the mesh the ``GlobalTensor`` s of ``specs`` (and of ``SavedTensor`` leaves of
            ``like``) are laid out on; default the current mesh.
        partial: read only the keys of ``like`` (a checkpoint may hold more).
        verify: compare every chunk read with the checksum the save recorded (the bytes'
            CRC-32, in the manifest); ``False`` skips it (a truncated file is still an error).

    A save of ``path`` that switches while the load reads gives the load one whole
    checkpoint, the previous or the new one, never parts of both (on every rank that reads a
    part of one ``GlobalTensor``, the same one: they compare which save they opened).

    Raises:
        FileNotFoundError: no checkpoint at ``path``, or a file of it missing (named).
        ValueError: keys of ``like`` missing from the checkpoint, keys of the checkpoint
            missing from ``like`` (unless ``partial``), or leaves whose global shape, dtype or
            kind differ (one error lists every such key path); a damaged checkpoint: a chunk
            whose checksum differs from the one saved, or a truncated file (the file, the key
            and the checkpoint named).
        TypeError: a leaf of ``like`` that names nothing to read, a spec leaf that is not a
            layout, both ``like`` and ``specs`` given or neither.
        RuntimeError: another rank reading the same values failed; saves replaced ``path``
            again and again while the load read it.

    Example:
        >>> import tempfile, torch, pshard as ps
        >>> mesh = ps.init_mesh({"dp": 1})
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> ps.save(path, {"w": ps.shard(torch.arange(4.0), ps.P("dp")), "step": 7})
        >>> ps.load(path, {"w": torch.empty(4), "step": 0})
        {'w': tensor([0., 1., 2., 3.]), 'step': 7}
        >>> ps.load(path, ps.load_metadata(path))["w"].spec
        P('dp')
    """
    from .._runtime.mesh import use_mesh
    from .load import like_from_specs
    from .load import load as run  # torch.distributed.checkpoint, loaded at the first call

    refuse("ps.load", "it reads files (load before the program runs, and pass what it read)")
    if (like is _NOT_GIVEN) == (specs is _NOT_GIVEN):
        raise TypeError(
            "load: give either like (the tree to read into) or specs (the layouts to read "
            "into: ps.load(path, specs=ps.P('dp')))"
            + (", not both" if specs is not _NOT_GIVEN else "")  # fmt: skip
        )
    with use_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        if specs is not _NOT_GIVEN:
            like = like_from_specs(path, specs, "load")
        return run(path, like, partial=partial, verify=verify)
