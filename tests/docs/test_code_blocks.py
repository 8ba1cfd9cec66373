"""Every code block of docs/ (and README.md) that is a complete Python script runs.

A ```python block is a complete script when it parses and every name it reads is bound
in the block itself (imported, assigned, defined) or is a builtin, and it holds no `...`
placeholder; the rest are fragments (they use `model`, `dataset`, ... from the text
around them) and are only checked to parse, as are interactive transcripts (`>>>`). A complete script runs on 1 rank; an HTML
comment `<!-- ranks: 2 -->` on the line before the block runs it on 2 (all the 2-rank
scripts in one launch, see tests/run_scripts.py). Adding a complete script to a page adds a test
here: the docs cannot rot.
"""

from __future__ import annotations

import ast
import builtins
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch import ROOT, explain, tarantella
from run_scripts import RUNNER, script_output

PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
_FENCE = re.compile(r"^(?P<ranks><!-- ranks: (?P<n>\d+) -->\n)?```python\n(?P<code>.*?)^```",
                    re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    ranks: int

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def source(self) -> str:
        """The Python in the block; for a `>>>` transcript, its input lines."""
        if not self.code.lstrip().startswith(">>>"):
            return self.code
        lines = [ln[4:] for ln in self.code.splitlines() if ln.startswith((">>> ", "... "))]
        return "\n".join(lines) + "\n"

    @property
    def is_transcript(self) -> bool:
        return self.source is not self.code


def python_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start("code")) + 1
            blocks.append(Block(page, line, m.group("code"), int(m.group("n") or 1)))
    return blocks


def unbound_names(code: str) -> set[str]:
    """Names the code reads but never binds (nor are builtins); {'...'} for a placeholder."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.Constant) and node.value is Ellipsis:
            read.add("...")
    return read - bound


BLOCKS = python_blocks()
SCRIPTS = [b for b in BLOCKS if not b.is_transcript and not unbound_names(b.code)]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_parses(block):
    ast.parse(block.source)


def test_the_guide_has_complete_scripts():
    # The classification above must keep finding the scripts the guide is meant to have:
    # if it stopped (a regex or parser change), the run test below would silently shrink.
    pages = {b.page.name for b in SCRIPTS}
    assert {"quickstart.md", "faq.md", "migration-horovod.md", "README.md"} <= pages, pages
    assert all(b.ranks in (1, 2) for b in SCRIPTS)


# Scripts on more than one rank share one launch per rank count (run_scripts.py): each
# rank imports TensorFlow once for all of them. 1-rank scripts run alone, as written (one
# sets TensorFlow's threading, which must come before any TensorFlow op of the process).
_shared_jobs: dict[int, subprocess.CompletedProcess] = {}


def _shared_job(ranks: int, tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess:
    """The one launch that runs every complete script meant for ``ranks`` ranks."""
    if ranks not in _shared_jobs:
        specs = []
        for n, block in enumerate(b for b in SCRIPTS if b.ranks == ranks):
            script = tmp_path_factory.mktemp(f"script{n}-") / "script.py"
            script.write_text(block.code, encoding="utf-8")
            specs.append(f"{block.id}=" + shlex.join([str(script.parent), str(script)]))
        _shared_jobs[ranks] = tarantella(ranks, RUNNER, *specs, cwd=tmp_path_factory.getbasetemp())
    return _shared_jobs[ranks]


@pytest.mark.parametrize("block", SCRIPTS, ids=[b.id for b in SCRIPTS])
def test_complete_script_runs(block, tmp_path, tmp_path_factory):
    if block.ranks == 1:
        script = tmp_path / "script.py"
        script.write_text(block.code, encoding="utf-8")
        proc = tarantella(block.ranks, script, cwd=tmp_path)
        assert proc.returncode == 0, f"{block.id} on 1 rank: {explain(proc)}"
        return
    proc = _shared_job(block.ranks, tmp_path_factory)
    assert script_output(proc.stdout, block.id) is not None, (
        f"{block.id} on {block.ranks} ranks failed or never started: {explain(proc)}")


@pytest.mark.parametrize("ranks", sorted({b.ranks for b in SCRIPTS if b.ranks > 1}))
def test_shared_launch_ends_cleanly(ranks, tmp_path_factory):
    # Every script done is not enough: the job must also exit 0 (no failure at shutdown).
    proc = _shared_job(ranks, tmp_path_factory)
    assert proc.returncode == 0, f"scripts on {ranks} ranks: {explain(proc)}"
