"""Expert parallelism for mixture-of-experts modules: each rank of a mesh axis holds ``E / n``
of the experts and its own tokens, which go to the ranks holding their experts and come back
(``ragged_all_to_all`` both ways, dropless), run by ``torch.func.functional_call`` on this
rank's blocks.

Private modules, one concept each (the public names are re-exported by ``pshard``):

- ``_plan``: a model resolved against an axis size (its experts modules, the parameters'
  specs); pure.
- ``_dispatch``: one experts call on this rank's tokens: the exchange, this rank's experts, the
  exchange back and the routing weights.
- ``_install``: the model while a block runs it (its experts' and its own ``forward`` and its
  load-balancing loss patched, counted per model) and the run found again by recomputations in
  backward passes.
- ``_api``: ``expert_parallel``, ``expert_parallel_specs``.
"""
