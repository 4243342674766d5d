"""The core: placements, spec trees, pytrees, annotations, layout math and argument checks.

Pure logic with no process group: modules here import torch and optree, never
``torch.distributed`` (beyond its placement types) and never another layer of pshard.
"""
