"""Microbatching: ``split``, ``merge``, streaming reducers, ``pmap_microbatch`` and batch-dim
inference.

Imports :mod:`pshard._core` and :mod:`pshard._runtime`.
"""
