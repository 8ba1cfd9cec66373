"""MkDocs hook: put the launcher's real ``--help`` text into the CLI reference page.

A page line ``<!-- cli-help -->`` becomes the output of ``tarantella --help`` from the
installed tnt-cli, so the reference never drifts from the options the launcher accepts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

MARKER = "<!-- cli-help -->"


def _help_text() -> str:
    found = shutil.which("tarantella", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise PluginError("the `tarantella` launcher is not installed; `nox -s docs` installs it")
    # A fixed width and no colours: the text goes into a code block.
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}
    proc = subprocess.run([found, "--help"], capture_output=True, text=True, env=env, timeout=60)
    if proc.returncode != 0:
        raise PluginError(f"`tarantella --help` exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout.rstrip()


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, f"```text\n$ tarantella --help\n{_help_text()}\n```")
