"""``ps.jit``: a function with pshard's transforms traced into one program and compiled (JAX's
``jax.jit``).

Private modules, one concept each (the public names are re-exported by ``pshard``):

- ``signature``: what a program is specialised to (the call flattened, its signature).
- ``program``: tracing one signature into a graph (collectives as ``pshard::`` nodes),
  donation, the errors of tracing; compiling it.
- ``jit``: ``ps.jit``, its cache, ``lower``.
"""
