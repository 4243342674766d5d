"""The examples run as they are (smoke tests: each checks its own numbers and exits non-zero);
the quickstart once as users run it, a script of its own with gloo processes; the others with
their ranks as threads, run as ``__main__`` in this process (``python script.py`` without the
interpreter's start and imports, the torch state they may change put back afterwards)."""

import contextlib
import io
import os
import pathlib
import runpy
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the ranks as threads of the example's process where processes are not what is tested
THREADS = ["--backend", "threads"]


@pytest.mark.parametrize(
    "script,args",
    [
        ("quickstart.py", ["--nprocs", "2", "--steps", "3"]),  # gloo processes, as users run it
        ("quickstart.py", ["--attention", "ring", "--microbatches", "3", "--steps", "2", *THREADS]),
        ("layouts.py", []),
        ("global_tensors.py", ["--nprocs", "2", "--steps", "3", *THREADS]),
        ("microbatch.py", []),
        ("attention.py", ["--nprocs", "2", *THREADS]),
        ("module_hooks.py", ["--nprocs", "2", *THREADS]),
        ("hf_llama.py", ["--nprocs", "2", "--steps", "3", "--checkpointing", *THREADS]),
        ("pipeline_llama.py", ["--steps", "2", *THREADS]),
        ("moe_expert_parallel.py", ["--steps", "2", *THREADS]),
        ("jit_llama.py", ["--steps", "3", "--compiler", "aot_eager", *THREADS]),
        ("llama_4d.py", ["--mesh", "dp=2,pp=2,tp=2,sp=1"]),  # 8 thread ranks (16 by default)
        ("llama_4d.py", ["--mesh", "dp=1,pp=2,tp=2,sp=2"]),
        (
            "functional_llama.py",
            ["--steps", "2", "--save-at", "1", "--microbatches", "1", *THREADS],
        ),
        (
            "functional_llama.py",
            [
                "--steps",
                "2",
                "--save-at",
                "1",
                "--microbatches",
                "1",
                "--dtype",
                "bf16",
                "--mesh",
                "dp=2,tp=2",
                *THREADS,
            ],
        ),  # fmt: skip
    ],
)
def test_example_runs(script: str, args: list[str]) -> None:
    path = ROOT / "examples" / script
    if "--nprocs" in args and "--backend" not in args:  # processes: a script of its own
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.run(
            [sys.executable, str(path), *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
    else:
        with _as_main(path, args) as captured:
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as exit:
                assert exit.code in (None, 0), f"{exit.code}\n{captured.getvalue()}"
        out = captured.getvalue()
    assert "max difference" in out, out


@contextlib.contextmanager
def _as_main(path: pathlib.Path, args: list[str]) -> Iterator[io.StringIO]:
    """``sys.argv`` and the working directory of ``python path *args``, its output captured;
    afterwards the interpreter's and torch's global state as it was."""
    argv, cwd, sys_path = sys.argv, os.getcwd(), list(sys.path)
    rng, dtype, threads = torch.get_rng_state(), torch.get_default_dtype(), torch.get_num_threads()
    grad = torch.is_grad_enabled()
    captured = io.StringIO()
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(captured):
            yield captured
    finally:
        sys.argv, sys.path[:] = argv, sys_path
        os.chdir(cwd)
        torch.set_rng_state(rng)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
