"""The figures of README.md, benchmarks/README.md and docs/*.md name where they come from.

What is checked, precisely:

- A *results citation* is a file name with a run date (``name_2026-12-04.jsonl``), a path under
  ``benchmarks/results/``, or an abbreviation of one (``..._b.jsonl``, ``name_2026-11-30*.jsonl``).
  Every one must match a file under ``benchmarks/results/`` (``*`` and ``...`` as wildcards).
- A *figure table* is a Markdown table with a throughput, latency or ratio in its body: a number
  followed by ms, us, tok/s, tokens/s, req/s, GB/s, TB/s or x. Its *context* is the text from the
  heading above it to the next heading (the table included). The context of every figure table
  must hold a results citation and a commit: ``commit abc1234`` in the text or an abbreviated
  hash in a cited file's name (``..._0a4e339.jsonl``), and every commit named must be one of
  this repository's (where git and its history are at hand).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

CITATION = re.compile(r"benchmarks/results/([\w.*-]+\.jsonl?)|([\w.*-]*_20\d\d-\d\d-\d\d[\w.*-]*\.jsonl?)"
                      r"|(\.\.\.[\w.*-]*\.jsonl?)")
FIGURE = re.compile(r"\d[\d,.]*\s*(?:ms|us|µs|tok/s|tokens/s|req/s|GB/s|TB/s|x)(?![\w/])")
COMMIT_IN_TEXT = re.compile(r"\bcommits? `?([0-9a-f]{7,40})\b")
COMMIT_IN_NAME = re.compile(r"_([0-9a-f]{7})(?=[_.])")
# Tables of figures that are not measurements, by (doc, heading): each says why.
NOT_MEASURED = {("docs/benchmarks.md", "## Machines and noise"): "the machines' specifications"}


def citations(text: str) -> list[str]:
    return [next(g for g in m.groups() if g) for m in CITATION.finditer(text)]


def cited_files(citation: str) -> list[Path]:
    return sorted(RESULTS.glob(citation.replace("...", "*")))


def commits(text: str) -> set[str]:
    return {*COMMIT_IN_TEXT.findall(text), *(c for name in citations(text) for c in COMMIT_IN_NAME.findall(name))}


def figure_tables(text: str) -> list[tuple[int, str, str]]:
    """(line, heading, context) of each figure table in a Markdown text."""
    lines = text.splitlines()
    sections, heading, start = [], "", 0
    for i, line in enumerate([*lines, "# end"]):
        if line.startswith("#"):
            sections.append((heading, start, i))
            heading, start = line, i
    found = []
    for heading, start, end in sections:
        context = "\n".join(lines[start:end])
        i = start
        while i < end:
            if not lines[i].startswith("|"):
                i += 1
                continue
            j = i
            while j < end and lines[j].startswith("|"):
                j += 1
            if any(FIGURE.search(row) for row in lines[i + 2:j]):
                found.append((i + 1, heading, context))
            i = j
    return found


def _known_commit(commit: str) -> bool:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--quiet", "--verify", f"{commit}^{{commit}}"],
                          capture_output=True)
    return done.returncode == 0


def _has_history() -> bool:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return False
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip()
    return shallow == "false"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_results_file_exists(doc):
    missing = [f"{doc.relative_to(ROOT)}:{n}: {c}" for n, line in enumerate(doc.read_text().splitlines(), 1)
               for c in citations(line) if not cited_files(c)]
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_table_names_its_results_file_and_commit(doc):
    rel = doc.relative_to(ROOT).as_posix()
    bare = []
    for line, heading, context in figure_tables(doc.read_text()):
        if (rel, heading) in NOT_MEASURED:
            continue
        if not citations(context) or not commits(context):
            bare.append(f"{rel}:{line} ({heading}): results file {citations(context)[:1]}, commit "
                        f"{sorted(commits(context))[:1]}")
    assert bare == []


@pytest.mark.skipif(not _has_history(), reason="needs the repository's git history")
def test_every_commit_the_docs_name_is_in_the_history():
    named = {(doc.relative_to(ROOT).as_posix(), c) for doc in DOCS for c in commits(doc.read_text())}
    assert sorted((doc, c) for doc, c in named if not _known_commit(c)) == []


def test_the_checks_see_what_they_are_meant_to():
    text = ("# T\n\n| a | b |\n| --- | --- |\n| c1 | 4.85 ms |\n\n## U\n\n(`serving_amd_2core_2026-12-03_0e4061f_vs_vllm"
            ".jsonl`, `..._b.jsonl`, commit 331a85c)\n\n| flag | default |\n| --- | --- |\n| `--x` | 30 s |\n\n"
            "| c | d |\n| --- | --- |\n| e | 1.12x |\n")
    tables = figure_tables(text)
    assert [(line, heading) for line, heading, _ in tables] == [(3, "# T"), (15, "## U")]
    assert citations(tables[0][2]) == [] and commits(tables[0][2]) == set()
    assert citations(tables[1][2]) == ["serving_amd_2core_2026-12-03_0e4061f_vs_vllm.jsonl", "..._b.jsonl"]
    assert commits(tables[1][2]) == {"0e4061f", "331a85c"}
    assert cited_files("gpu_check_h200_2026-11-30*.jsonl") == sorted(RESULTS.glob("gpu_check_h200_2026-11-30*"))
    assert len(cited_files("gpu_check_h200_2026-11-30*.jsonl")) == 3 and cited_files("nothing_2026-01-01.jsonl") == []
