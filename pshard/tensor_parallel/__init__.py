"""Tensor parallelism for modules: layers split over a mesh axis, run by
``torch.func.functional_call`` on this rank's blocks (torch's ``parallelize_module`` styles for
functional code), and the cross-entropy of vocabulary-split logits.

Private modules, one concept each (the public names are re-exported by ``pshard``):

- ``_loss``: ``cross_entropy`` on logits split over the vocabulary.
- ``_plan``: a plan resolved against a model (styles, layers, parameters' specs); pure.
- ``_layers``: what a split layer computes on this rank's blocks, style by style.
- ``_install``: the model while a block runs it (its layers' ``forward`` patched, counted per
  model) and the run found again by recomputations in backward passes.
- ``_api``: ``tensor_parallel``, ``tensor_parallel_specs``, ``tensor_parallel_plan``.
"""
