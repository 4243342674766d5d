"""A training script for torchrun with --max-restarts (tests/test_elastic.py): AdamW on a
sharded weight, an async save after each step, resumed from the checkpoint at start; on the
first attempt rank 1 is killed (SIGKILL) right after it issued the save of step 3. Prints
each rank's final weights as JSON."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

import pshard as ps

STEPS = 6


def loss_grad(w: torch.Tensor, step: int) -> torch.Tensor:
    return torch.sin(w * (step + 1))  # a gradient that depends on the step and the weights


def run(path: str, kill_at: int) -> list[float]:
    """Train (resuming from ``path`` if it holds a checkpoint); this rank's final weights."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ps.init_mesh({"dp": torch.distributed.get_world_size() if torch.distributed.is_initialized()
                  else int(os.environ.get("WORLD_SIZE", "1"))})  # fmt: skip
    opt = ps.optim.adamw(0.1)
    w = ps.shard(torch.linspace(-1.0, 1.0, 8, dtype=torch.float64), ps.P("dp"))
    state = {"w": w, "opt": opt.init(w), "step": 0}
    if os.path.exists(path):  # resume: the last checkpoint the ranks switched in, whole
        state = ps.load(path, state)
    future = None
    for step in range(state["step"], STEPS):
        g = ps.GlobalTensor(loss_grad(state["w"].local, step), state["w"].meta)
        updates, opt_state = opt.update(g, state["opt"], state["w"])
        state = {"w": ps.optim.apply_updates(state["w"], updates), "opt": opt_state,
                 "step": step + 1}  # fmt: skip
        if future is not None:
            future.result()
        future = ps.save(path, state, async_save=True)
        if attempt == 0 and step + 1 == kill_at and torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # lost right after issuing the save
    if future is not None:
        future.result()
    final: list[float] = ps.gather(state["w"]).tolist()
    return final


if __name__ == "__main__":
    print("FINAL " + json.dumps(run(sys.argv[1], int(sys.argv[2]))), flush=True)
