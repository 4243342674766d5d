"""Check pshard's house rules on its import graph (run by CI and by tests/test_architecture.py).

    python tools/check_layers.py          # prints each violation, exits 1 if there is any

Rules (docs/architecture.md):

1. Layers: a module imports only its own layer and the layers below it (the table below, lowest
   first; rooms on one line are siblings and do not import each other).
2. No cycle between modules (lazy imports inside functions count too).
3. A name with one leading underscore is private to its module: no ``from m import _name``
   across modules of the package.
4. ``pshard/_core`` is pure: it never imports ``torch.distributed`` beyond DTensor's placement
   types.
5. ``pshard/__init__.py`` only re-exports: imports, ``__all__`` and ``__version__``.
6. Private torch APIs only in ``pshard/_compat/``: no other module imports a private torch
   module (``torch._C``, ``torch.utils._pytree``) or reads ``torch._name``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pshard"

#: Rooms, lowest first; an entry with several rooms makes siblings.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pshard._compat",),
    ("pshard._core",),
    ("pshard._runtime",),
    ("pshard._collectives",),
    ("pshard._remat",),
    ("pshard._shard_map",),
    ("pshard._modules",),
    ("pshard._jit",),
    (
        "pshard._microbatch",
        "pshard.sequence",
        "pshard._state",
        "pshard.optim",
        "pshard.tensor_parallel",
        "pshard.expert_parallel",
        "pshard._inspect",
    ),
    ("pshard._pipeline",),
    ("pshard.integrations",),
    ("pshard",),
)

_CORE_MAY_IMPORT = ("torch.distributed.tensor.placement_types", "torch.distributed.tensor")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> tuple[int, str]:
    """(layer index, room) of a pshard module."""
    best: tuple[int, str] | None = None
    for level, rooms in enumerate(LAYERS):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and (
                best is None or len(room) > len(best[1])
            ):
                best = (level, room)
    if best is None:
        raise ValueError(f"{module} is in no layer of tools/check_layers.py")
    return best


def imports(path: Path, module: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, names) for every import in ``path``, lazy ones included."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = tuple(a.name for a in node.names)
            if node.level and not node.module:  # from . import x: x may be a module
                out += [(node.lineno, f"{target}.{n}", ()) for n in names]
            else:
                out.append((node.lineno, target, names))
    return out


def known(modules: set[str], target: str) -> str | None:
    """The pshard module ``target`` names (a module, or a package whose __init__ holds it)."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def check() -> list[str]:
    files = sorted(PACKAGE.rglob("*.py"))
    names = {module_name(p): p for p in files}
    modules = set(names)
    problems: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in names.items():
        level, room = room_of(module)
        rel = path.relative_to(ROOT)
        for line, target, imported in imports(path, module):
            where = f"{rel}:{line}"
            if room == "pshard._core" and target.startswith("torch.distributed"):
                if not target.startswith(_CORE_MAY_IMPORT):
                    problems.append(f"{where}: the core imports {target} (rule 4)")
            if room != "pshard._compat" and _private_torch(target, imported):
                problems.append(f"{where}: imports the private torch API {target} (rule 6)")
            if not (target == "pshard" or target.startswith("pshard.")):
                continue
            dest = known(modules, target)
            if dest is None:
                problems.append(f"{where}: imports {target}, which is not a module of pshard")
                continue
            if dest != module:
                graph[module].add(dest)
            dest_level, dest_room = room_of(dest)
            if dest_level > level or (dest_level == level and dest_room != room):
                problems.append(
                    f"{where}: {module} ({room}) imports {dest} ({dest_room}), a layer above "
                    f"or beside its own (rule 1)"
                )
            private = [n for n in imported if n.startswith("_") and not n.startswith("__")]
            if private and dest != module:
                problems.append(f"{where}: imports private names {private} from {dest} (rule 3)")
        if room != "pshard._compat":
            problems += _private_torch_attributes(path, rel)
    problems += _cycles(graph)
    problems += _init_only_reexports(PACKAGE / "__init__.py")
    return problems


def _private_torch(target: str, imported: tuple[str, ...]) -> bool:
    parts = target.split(".")
    if parts[0] != "torch":
        return False
    return any(p.startswith("_") for p in parts[1:] + list(imported) if not p.startswith("__"))


def _private_torch_attributes(path: Path, rel: Path) -> list[str]:
    """``torch._name`` read in ``path`` (``torch._C._x``, ``torch._dynamo``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            out.append(
                f"{rel}:{node.lineno}: reads the private torch API torch.{node.attr} (rule 6)"
            )
    return out


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per import cycle (each found once, from its smallest module)."""
    out: list[str] = []
    seen: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        stack = [(start, (start,))]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    cycle = path
                    key = tuple(sorted(cycle))
                    if key not in seen:
                        seen.add(key)
                        out.append("import cycle (rule 2): " + " -> ".join((*cycle, start)))
                elif nxt not in path and nxt > start:
                    stack.append((nxt, (*path, nxt)))
    return out


def _init_only_reexports(path: Path) -> list[str]:
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id in ("__all__", "__version__") for t in targets):
                continue
        out.append(f"pshard/__init__.py:{node.lineno}: not a re-export (rule 5)")
    return out


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    print(f"check_layers: {len(problems)} problem(s)" if problems else "check_layers: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
