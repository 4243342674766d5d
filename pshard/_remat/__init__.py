"""Rematerialisation under ``torch.func``: ``ps.checkpoint`` / ``ps.remat``, ``ps.checkpoint_name``
and ``ps.checkpoint_policies`` (JAX's ``jax.checkpoint`` and its policies).

Modules, bottom up: ``compat`` (the private torch APIs this room needs, in one place), ``rng``
(generator states), ``policies`` (what a policy is, the built-in ones, operator classes),
``tape`` (the dispatch-level record of a forward and its replay in the recompute), ``names``
(``checkpoint_name``), ``lift`` (the parameters of modules a function uses, as its arguments)
and ``checkpoint`` (the transform and its ``torch.autograd.Function``).

Imports torch, :mod:`pshard._core` and nothing from the layers above it; the layers below
never import it.
"""
