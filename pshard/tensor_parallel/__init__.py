"""Tensor parallelism for modules: layers split over a mesh axis, run by
``torch.func.functional_call`` on this rank's blocks (torch's ``parallelize_module`` styles for
functional code), and the cross-entropy of vocabulary-split logits.

Private modules, one concept each (the public names are re-exported by ``pshard``):

- ``_loss``: ``cross_entropy`` on logits split over the vocabulary.
"""
