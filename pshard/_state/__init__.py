"""Sharded save and restore: ``ps.save`` / ``ps.load`` / ``ps.load_metadata`` on
``torch.distributed.checkpoint``'s on-disk format.

Modules, bottom up: ``rng`` (random generator states as plain data), ``manifest`` (what a
checkpoint holds per leaf and the tree's structure, the save's id and every chunk's checksum,
as JSON beside DCP's files), ``opened`` (a checkpoint directory opened once), ``reader``
(DCP's metadata read without running an arbitrary pickle; every chunk read checked),
``atomic`` (writing aside and the one-step switch), ``comm`` (the ranks' exchanges during a
save), ``records`` (the leaves of a tree to save and the ranks' agreement on them, copies
included), ``hf`` (Hugging Face model directories: safetensors headers read by pshard,
torch's ``HuggingFaceStorageReader`` and ``HuggingFaceStorageWriter``), ``write`` (DCP's save
protocol), ``read`` (one whole checkpoint read while saves switch the path), ``save`` and
``load`` (the public functions). ``docs/checkpoints.md``
describes the whole.

Imports :mod:`pshard._compat`, :mod:`pshard._core`, :mod:`pshard._runtime` and
:mod:`pshard._shard_map`; sits beside :mod:`pshard._microbatch` and :mod:`pshard.sequence`.
"""
