"""The differentiable collectives (``functions``) and their compiled forms (``compiled``).

Imports :mod:`pshard._core` and :mod:`pshard._runtime`.
"""
