"""Seeing what a layout does: ``ps.visualize_sharding`` (which ranks hold which block) and
``ps.memory_estimate`` (the bytes a layout takes per rank, from shapes alone). Pure: layouts
and shapes in, text and numbers out."""
