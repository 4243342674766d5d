"""Integrations with other libraries, each importing its library only when used.

Each implements the model-adapter protocol of :mod:`pshard._modules.adapter` and registers its
adapter when imported; the rooms that use adapters never import an integration.

- ``transformers``: Hugging Face models under :func:`pshard.sequence_parallel` (their attention
  interface, their masks, their label and loss conventions).
"""
