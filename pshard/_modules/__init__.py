"""What pshard's model-level rooms (:mod:`pshard.sequence`, :mod:`pshard.tensor_parallel`) share
about ``nn.Module`` s of families they do not own: the model-adapter protocol and its registry
(:mod:`pshard._modules.adapter`), implemented by :mod:`pshard.integrations`.

Imports torch only; the rooms above import it, never an integration.
"""
