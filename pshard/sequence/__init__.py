"""Sequence parallelism: one sequence split over the ranks of a mesh axis.

Private modules, one concept each (the public names are re-exported by ``pshard``):

- ``_layouts``: padding and the token permutations (``"contiguous"``, ``"zigzag"``,
  ``"stripe"``); pure index math, kept in one place.
- ``_context``: the sequence context (layout and padding of the current split, a context
  variable) and ``seq_positions``.
- ``_shard_map_seq``: ``shard_map_seq``, built on ``shard_map``.
- ``_heads``: the Ulysses all-to-alls between sequence-sharded and head-sharded tensors
  (``seq_to_heads`` / ``heads_to_seq``).
- ``_ulysses``: ``ulysses_attention``.
- ``_ring``: ``ring_attention`` (K/V blocks around the axis, online softmax, skipped masked
  blocks, a recomputing backward).
- ``_usp``: ``usp_attention`` (Ulysses over one axis, ring attention over another).
- ``_lm``: causal-LM batches and losses (``prepare_lm_batch``, ``token_mean_loss``).
- ``_hooks``: ``sequence_parallel`` module hooks and ``reduce_gradients``.
- ``_broadcast``: every rank's batch in turn to the whole axis (``broadcast_batches``).
"""
