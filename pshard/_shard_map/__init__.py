"""``shard_map`` and the boundary of a map (values whole outside, blocks inside).

Imports the layers below: :mod:`pshard._core`, :mod:`pshard._runtime`,
:mod:`pshard._collectives`.
"""
