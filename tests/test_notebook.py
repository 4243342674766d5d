"""The example notebook runs as it is, on ranks that are threads of its kernel."""

from __future__ import annotations

import pathlib

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_example_notebook_runs() -> None:
    notebook = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    # outputs are stripped in the repository: the notebook is run from scratch
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
    nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    errors = [
        out
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors, errors
