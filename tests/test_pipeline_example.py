"""The pipeline example runs as it is (it checks its own losses against one process and exits
non-zero when they differ), as tests/test_examples.py runs the others."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
THREADS = ["--backend", "threads"]  # the ranks as threads: processes are not the point here


def test_hugging_face_llama_in_pipeline_stages_trains_as_one_process():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "pipeline_llama.py"), "--steps", "2", *THREADS],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max difference over 3 ranks and 2 steps" in proc.stdout
