"""Sequence parallelism: one sequence split over the ranks of a mesh axis.

Private modules, one concept each (the public names are re-exported by ``pshard``), listed from
the bottom up (a module imports only modules above it in this list):

- ``_layouts``: padding and the token permutations (``"contiguous"``, ``"zigzag"``,
  ``"stripe"``); pure index math, kept in one place.
- ``_masks``: attention masks by global position (causal, sliding windows, segment ids).
- ``_context``: the sequence context (layout and padding of the current split, a context
  variable, found again by recomputations in the backward pass) and ``seq_positions``.
- ``_seq_boundary``: a whole value to this rank's tokens and back, for ``shard_map_seq`` and
  the ``sequence_parallel`` hooks.
- ``_shard_map_seq``: ``shard_map_seq``, built on ``shard_map``.
- ``_heads``: the Ulysses all-to-alls between sequence-sharded and head-sharded tensors
  (``seq_to_heads`` / ``heads_to_seq``); ``_exchange``: the same with the layout folded into
  their buffers, for ``ulysses_attention``.
- ``_qkv``: the argument checks the attention functions share.
- ``_ulysses``: ``ulysses_attention``.
- ``_kernels``: the fused kernels a ring block runs on (CPU flash, CUDA efficient attention).
- ``_ring_schedule``: which blocks ring attention computes, with which mask, from positions.
- ``_ring_blocks``: one ring block and its gradient, and the online softmax merge.
- ``_ring_pass``: the forward and backward passes around the ring and their autograd Function.
- ``_ring``: ``ring_attention``.
- ``_usp``: ``usp_attention`` (Ulysses over one axis, ring attention over another).
- ``_lm``: causal-LM batches and losses (``prepare_lm_batch``, ``token_mean_loss``) and the
  names of the batch's keys.
- ``plug``: the attention ``sequence_parallel(attention=...)`` plugs into a model, which the
  attention layers of a model adapter (:mod:`pshard._modules.adapter`, implemented by
  ``pshard.integrations``) call; this package never imports an integration.
- ``_hooks``: ``sequence_parallel`` module hooks and ``reduce_gradients``.
- ``_broadcast``: every rank's batch in turn to the whole axis (``broadcast_batches``).
"""
