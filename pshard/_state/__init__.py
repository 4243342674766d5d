"""Sharded save and restore: ``ps.save`` / ``ps.load`` / ``ps.load_metadata`` on
``torch.distributed.checkpoint``'s on-disk format.

Modules, bottom up: ``rng`` (random generator states as plain data), ``manifest`` (what a
checkpoint holds per leaf and the tree's structure, as JSON beside DCP's files), ``reader``
(DCP's metadata read without running an arbitrary pickle), ``atomic`` (writing aside and the
one-step switch), ``comm`` (the ranks' exchanges during a save), ``records`` (the leaves of a
tree to save and the ranks' agreement on them), ``write`` (DCP's save protocol), ``save`` and
``load`` (the public functions). ``docs/checkpoints.md`` describes the whole.

Imports :mod:`pshard._compat`, :mod:`pshard._core`, :mod:`pshard._runtime` and
:mod:`pshard._shard_map`; sits beside :mod:`pshard._microbatch` and :mod:`pshard.sequence`.
"""
