"""MkDocs hook: publish the repository files that pages link to, under ``repo/``.

The guide links to files beside docs/ (``../examples/resnet50.py``,
``../benchmarks/results/summary.md``) so that the links also work when browsing the
repository. MkDocs only knows files inside docs/; this hook adds each linked file that
exists as ``repo/<path in the repository>`` and rewrites the link to it. A link to a
file that does not exist is left alone, so the strict build still reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

_LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
_PREFIX = "repo"

# Absolute path of each published repository file -> its src_uri in the site.
_published: dict[Path, str] = {}


def _targets(source: Path, text: str, docs_dir: Path, root: Path) -> list[Path]:
    """Existing repository files outside docs/ that ``text`` (the file ``source``) links to."""
    found = []
    for match in _LINK.finditer(text):
        link = match.group(2)
        if "://" in link or link.startswith(("/", "mailto:")):
            continue
        target = (source.parent / link).resolve()
        if target.is_file() and target.is_relative_to(root) and not target.is_relative_to(docs_dir):
            found.append(target)
    return found


def on_files(files: Files, config) -> Files:
    docs_dir = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    _published.clear()
    todo = [Path(f.abs_src_path) for f in files.documentation_pages()]
    seen: set[Path] = set()
    while todo:
        source = todo.pop()
        if source in seen:
            continue
        seen.add(source)
        for target in _targets(source, source.read_text(encoding="utf-8"), docs_dir, root):
            if target in _published:
                continue
            uri = f"{_PREFIX}/{target.relative_to(root).as_posix()}"
            _published[target] = uri
            files.append(File.generated(config, uri, abs_src_path=str(target)))
            if target.suffix == ".md":
                todo.append(target)  # a published page's own links (e.g. its images)
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    source = Path(page.file.abs_src_path).resolve()
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target = (source.parent / match.group(2)).resolve()
        uri = _published.get(target)
        if uri is None:
            return match.group(0)
        return f"{match.group(1)}{posixpath.relpath(uri, here or '.')}{match.group(3)}"

    return _LINK.sub(rewrite, markdown)
