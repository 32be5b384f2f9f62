"""The tree shows the architecture (DESIGN.md's layout, STYLE.md rules 10-12): small folders,
a one-line docstring per sub-package, every package installed, no pickle in the engine or the
router, and no measurements or run history in package code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
TOP = {"worker": "pagefleet.worker", "router": "pagefleet.router", "cluster": "pagefleet.cluster",
       "kernels": "pagefleet.kernels"}
MAX_MODULES = 16


def _package_dirs() -> list[Path]:
    return [d for top in TOP for d in [ROOT / top, *sorted((ROOT / top).rglob("*"))]
            if d.is_dir() and d.name != "__pycache__"]


def _modules(top: str) -> list[Path]:
    return sorted((ROOT / top).rglob("*.py"))


@pytest.mark.parametrize("folder", _package_dirs(), ids=lambda d: str(d.relative_to(ROOT)))
def test_a_folder_holds_at_most_16_modules(folder):
    modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= MAX_MODULES, sorted(p.name for p in modules)


def test_every_sub_package_has_a_one_line_docstring_and_is_installed():
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for folder in _package_dirs():
        top, *rest = folder.relative_to(ROOT).parts
        name = ".".join([TOP[top], *rest])
        assert name in packages, f"{name} is not in pyproject's packages"
        if rest:  # kernels/ itself has no __init__.py (tests/test_import_names.py says why)
            doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
            assert doc and "\n" not in doc.strip(), f"{folder}: {doc!r}"


@pytest.mark.parametrize("top", ["worker", "router"])
def test_no_module_of_the_engine_or_the_router_imports_pickle(top):
    for path in _modules(top):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("pickle", "cloudpickle", "dill") for n in names), path


# A dated results file, a run date, or a commit cited in prose.
_HISTORY = re.compile(r"20\d\d-\d\d-\d\d|\w+_20\d\d\S*\.jsonl|\bcommit [0-9a-f]{7}\b")


@pytest.mark.parametrize("top", list(TOP))
def test_no_package_module_cites_a_dated_result(top):
    cited = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _modules(top)
             for i, line in enumerate(p.read_text().splitlines(), 1) if _HISTORY.search(line)]
    assert cited == []


def test_the_readme_is_a_first_five_minutes_and_docs_hold_the_rest():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 250
    assert any("make serve" in line for line in readme[:40])
    for page in re.findall(r"\]\((docs/[\w./-]+\.md)\)", "\n".join(readme)):
        assert (ROOT / page).is_file(), page
    assert "```mermaid" in (ROOT / "docs" / "architecture.md").read_text()
