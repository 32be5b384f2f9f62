"""Dependencies point one way (docs/architecture.md, "Folders"): kernels <- worker <- router <- cluster.

Every import in every module under worker/, router/ and kernels/ is read, those inside functions
and under ``TYPE_CHECKING`` included, and so is ``importlib.import_module`` of a constant name:

- nothing under worker/, router/ or kernels/ imports ``pagefleet.cluster``;
- kernels/ imports neither ``pagefleet.worker`` nor ``pagefleet.router``;
- worker/ never imports ``pagefleet.router``;
- inside worker/, only the engine's drivers (worker/engine/, worker/replica/ and the package's
  ``__init__``) import ``pagefleet.worker.engine``: the parts the engine drives (core,
  model_executor, parallel, ...) sit below it and take its options from ``worker/engine_args.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = {"worker": "pagefleet.worker", "router": "pagefleet.router", "kernels": "pagefleet.kernels"}

# (folder, imported package it must not reach, the paths under the folder allowed to)
RULES = [
    ("worker", "pagefleet.cluster", ()),
    ("router", "pagefleet.cluster", ()),
    ("kernels", "pagefleet.cluster", ()),
    ("kernels", "pagefleet.worker", ()),
    ("kernels", "pagefleet.router", ()),
    ("worker", "pagefleet.router", ()),
    ("worker", "pagefleet.worker.engine", ("worker/engine/", "worker/replica/", "worker/__init__.py")),
]


def module_name(path: Path) -> str:
    """The dotted name ``path`` installs as (pyproject's package-dir maps each folder)."""
    top, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGE[top], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of every module ``source`` imports, relative imports resolved against
    ``module``; ``from a import b`` gives ``a.b`` (b may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def _reaches(name: str, target: str) -> bool:
    return name == target or name.startswith(target + ".")


def violations(folder: str, target: str, allowed: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(allowed):
            continue
        names = imported_names(path.read_text(), module_name(path), path.name == "__init__.py")
        lines = {line: name for line, name in reversed(names) if _reaches(name, target)}  # the shortest a line
        out += [f"{rel}:{line} imports {name}" for line, name in sorted(lines.items())]
    return out


@pytest.mark.parametrize("folder,target,allowed", RULES, ids=[f"{f}-not-{t}" for f, t, _ in RULES])
def test_dependencies_point_one_way(folder, target, allowed):
    assert violations(folder, target, allowed) == []


def test_the_reader_sees_every_kind_of_import():
    """The check itself: an import in a function, under TYPE_CHECKING, relative, of a package's
    module by ``from``, and by importlib are all seen, each on its line."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pagefleet.cluster.plan.cli import PlanArgs\n"
        "def f():\n"
        "    import pagefleet.router.ingress as ingress\n"
        "    from ... import cluster\n"
        "    from ..engine import llm_engine\n"
        "    importlib.import_module('pagefleet.cluster.app')\n"
        "from pagefleet import worker\n"
    )
    names = imported_names(source, "pagefleet.worker.core.scheduler")
    assert [(line, n) for line, n in names if n.startswith("pagefleet.") and n.count(".") >= 2] == [
        (3, "pagefleet.cluster.plan.cli"), (3, "pagefleet.cluster.plan.cli.PlanArgs"),
        (5, "pagefleet.router.ingress"), (7, "pagefleet.worker.engine"), (7, "pagefleet.worker.engine.llm_engine"),
        (8, "pagefleet.cluster.app")]
    assert (6, "pagefleet.cluster") in names and (9, "pagefleet.worker") in names
    assert _reaches("pagefleet.cluster", "pagefleet.cluster") and not _reaches("pagefleet.clusters", "pagefleet.cluster")


def test_module_names_follow_the_package_dirs():
    assert module_name(ROOT / "worker/core/scheduler.py") == "pagefleet.worker.core.scheduler"
    assert module_name(ROOT / "router/openai/__init__.py") == "pagefleet.router.openai"
    assert module_name(ROOT / "kernels/ops.py") == "pagefleet.kernels.ops"
