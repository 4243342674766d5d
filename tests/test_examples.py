"""The examples run as they are (smoke tests: each checks its own numbers and exits non-zero);
the quickstart once on gloo processes, the others with their ranks as threads."""

import os
import pathlib
import subprocess
import sys

import pytest

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
def test_example_runs(script, args):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max difference" in proc.stdout
