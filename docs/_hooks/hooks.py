"""MkDocs hooks for joinkit's site (``mkdocs.yml``: ``hooks:``).

Theory of operation. The site is built from the repository as it is, offline,
with ``mkdocs build --strict`` (every warning fails the build). Four things are
done at build time, none of which fetches anything:

- the protocol page's marker ``<!-- protocol-diagram -->`` becomes the diagram
  generated from ``joinkit._machine.TRANSITIONS`` (``protocol.py``);
- ``benchmarks/RESULTS.md`` (written by ``benchmarks/run.py``, outside
  ``docs/``) is added to the site as ``benchmarks.md``;
- a link from a page to a file of the repository outside ``docs/`` (an
  example, a test) renders as its text: the site has no copy of that file, and
  on GitHub the link still works. A link to a file that does not exist is left
  as it is, so ``--strict`` fails on it;
- nav entries under ``extra.coming_pages`` (pages other branches add) are
  dropped while their file is missing, so the nav can name them before they
  land and the build stays warning-free.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import protocol  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
_LINK = re.compile(r"\[([^\]\n]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def _prune(nav: Any, docs_dir: str, coming: set[str]) -> Any:
    if isinstance(nav, list):
        kept = [_prune(item, docs_dir, coming) for item in nav]
        return [item for item in kept if item is not None]
    if isinstance(nav, dict):
        (title, value), = nav.items()
        value = _prune(value, docs_dir, coming)
        if value is None or value == []:
            return None
        return {title: value}
    if isinstance(nav, str) and nav in coming and not os.path.exists(os.path.join(docs_dir, nav)):
        return None
    return nav


def on_config(config: Any) -> Any:
    coming = set(config["extra"].get("coming_pages", []))
    config["nav"] = _prune(config["nav"], config["docs_dir"], coming)
    return config


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    with open(RESULTS, encoding="utf-8") as f:
        files.append(File.generated(config, "benchmarks.md", content=f.read()))
    return files


def _unlink_outside(markdown: str, page_path: str, docs_dir: str) -> str:
    here = os.path.dirname(os.path.join(docs_dir, page_path))

    def replace(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        resolved = os.path.normpath(os.path.join(here, target))
        inside = resolved.startswith(os.path.normpath(docs_dir) + os.sep)
        if inside or not os.path.exists(resolved):
            return match.group(0)
        return text

    return _LINK.sub(replace, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if protocol.MARKER in markdown:
        markdown = markdown.replace(protocol.MARKER, protocol.render())
    if page.file.generated_by is None:
        markdown = _unlink_outside(markdown, page.file.src_uri, config["docs_dir"])
    return markdown
