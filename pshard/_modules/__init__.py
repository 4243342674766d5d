"""What pshard's model-level rooms (:mod:`pshard.sequence`, :mod:`pshard.tensor_parallel`) share
about ``nn.Module`` s: the model-adapter protocol and its registry (:mod:`pshard._modules.adapter`,
implemented by :mod:`pshard.integrations` for the families pshard does not own), and the calls
made inside a block that the backward passes through them find again
(:mod:`pshard._modules.passes`, for recomputed layers).

The rooms above import it, never an integration.
"""
