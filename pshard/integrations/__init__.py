"""Integrations with other libraries, each importing its library only when used.

- ``transformers``: Hugging Face models under :func:`pshard.sequence_parallel` (their attention
  interface, their masks, their label and loss conventions).
"""
