"""The house rules on pshard's own source (docs/architecture.md): layers, cycles, private names
across modules, a pure core, a re-export-only ``__init__``, modules readable in one sitting."""

from __future__ import annotations

import importlib.util
import pathlib

import pshard as ps

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _checker():  # tools/ is not a package: load the script as a module
    spec = importlib.util.spec_from_file_location(
        "check_layers", ROOT / "tools" / "check_layers.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_import_graph_follows_the_layers() -> None:
    assert _checker().check() == []


def test_checker_finds_an_upward_import_and_private_names(tmp_path, monkeypatch) -> None:
    """The checker is not vacuous: a core module importing the runtime, a private name imported
    across modules and a private torch API used outside ``pshard/_compat/`` are reported."""
    checker = _checker()
    package = tmp_path / "pshard"
    (package / "_core").mkdir(parents=True)
    (package / "_runtime").mkdir()
    (package / "__init__.py").write_text('"""doc."""\nfrom ._core.a import f as f\n')
    (package / "_core" / "__init__.py").write_text("")
    (package / "_runtime" / "__init__.py").write_text("")
    (package / "_core" / "a.py").write_text("from .._runtime.b import _g\n\ndef f(): ...\n")
    (package / "_runtime" / "b.py").write_text(
        "import torch\nfrom torch.utils._pytree import tree_map\n\ndef _g(): torch._C.x()\n"
    )
    monkeypatch.setattr(checker, "ROOT", tmp_path)
    monkeypatch.setattr(checker, "PACKAGE", package)
    problems = checker.check()
    assert any("a layer above" in p for p in problems), problems
    assert any("private names ['_g']" in p for p in problems), problems
    assert any("private torch API torch.utils._pytree" in p for p in problems), problems
    assert any("private torch API torch._C" in p for p in problems), problems


def test_modules_are_readable_in_one_sitting() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "pshard").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}


def test_package_is_typed_and_versioned() -> None:
    assert (ROOT / "pshard" / "py.typed").exists()
    assert ps.__version__ and ps.__version__[0].isdigit()
