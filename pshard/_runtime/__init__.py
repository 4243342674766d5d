"""The runtime: the device mesh, spawned ranks, debug mode and the wire (raw communication).

Imports :mod:`pshard._core` only.
"""
