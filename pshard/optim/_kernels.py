"""torch's multi-tensor (``foreach``) kernels that the transforms run, looked up once.

Each takes lists of tensors of one device and dtype (and scalars), as ``torch.optim``'s foreach
paths call them: one call per list, a fused kernel on CUDA, a loop in C++ on the CPU. The
names are torch's without the ``_foreach_`` prefix; a trailing underscore writes in place.
"""

from __future__ import annotations

from .._compat import foreach

__all__ = [
    "add",
    "add_",
    "addcdiv_",
    "addcmul_",
    "div_",
    "lerp",
    "lerp_",
    "mul",
    "mul_",
    "norm",
    "sqrt",
]

add = foreach("add")
add_ = foreach("add_")
addcdiv_ = foreach("addcdiv_")
addcmul_ = foreach("addcmul_")
div_ = foreach("div_")
lerp = foreach("lerp")
lerp_ = foreach("lerp_")
mul = foreach("mul")
mul_ = foreach("mul_")
norm = foreach("norm")
sqrt = foreach("sqrt")
