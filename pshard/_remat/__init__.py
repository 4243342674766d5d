"""Rematerialisation under ``torch.func``: ``ps.checkpoint`` / ``ps.remat``, ``ps.checkpoint_name``
and ``ps.checkpoint_policies`` (JAX's ``jax.checkpoint`` and its policies).

Modules, bottom up (the private torch APIs it needs are in :mod:`pshard._compat`): ``rng``
(generator states), ``modes`` (autocast and the default dtype of a forward), ``names``
(``checkpoint_name``), ``policies`` (what a policy is, the built-in ones, operator classes),
``ops`` (what kind of operator the tape sees), ``tape`` (the dispatch-level record of a
forward), ``explain`` (how a recompute's call differs from the forward's, for errors),
``replay`` (its replay in the recompute), ``lift`` (the parameters of modules a function uses,
as its arguments), ``function`` (the ``torch.autograd.Function`` and the call it carries) and
``checkpoint`` (the transform).

Imports torch, :mod:`pshard._core` and nothing from the layers above it; the layers below
never import it.
"""
