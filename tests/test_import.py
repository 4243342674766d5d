"""``import pshard`` loads what every program needs and no more: torch.compile's front end
(dynamo) only once something compiles (pshard's functions that must stay out of compiled graphs
are disabled for dynamo as it is imported), torch.distributed.checkpoint and DTensor only once
a checkpoint is saved or loaded, or a DTensor converted."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import pshard
from pshard._collectives import apply, rules
heavy = [
    m
    for m in ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor")
    if m in sys.modules
]
before = hasattr(apply.eager, "_torchdynamo_disable")
import torch._dynamo
after = [
    getattr(f, "_torchdynamo_disable", False)
    for f in (apply.eager, rules.FUNCTIONS["psum"].forward, rules.FUNCTIONS["psum"].backward)
]
print(heavy, before, after)
"""


def test_import_leaves_dynamo_until_something_compiles() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[] False [True, True, True]"
