"""Integrations with other libraries, each importing its library only when used.

Each implements the model-adapter protocol of :mod:`pshard.sequence.adapter` and registers its
adapter when imported; the sequence-parallel core never imports an integration.

- ``transformers``: Hugging Face models under :func:`pshard.sequence_parallel` (their attention
  interface, their masks, their label and loss conventions).
"""
