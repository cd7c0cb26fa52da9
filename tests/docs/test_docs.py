"""The documentation: the site builds with warnings as errors, the protocol
diagram is the machine's table, and README.md stays a short front page.

The site build (``mkdocs build --strict``, mkdocs.yml) is what ``make docs``
runs; here it runs into a temporary folder, once for the real pages and once
for a copy with a broken link, which must fail.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"
sys.path.insert(0, str(ROOT / "docs" / "_hooks"))

import protocol  # noqa: E402

from joinkit import _machine  # noqa: E402


def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(root / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT, out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    return out


@pytest.mark.launches
def test_the_site_builds_strict_with_every_page(site: Path) -> None:
    for page in ("index.html", "guide/quickstart/index.html", "reference/joinkit/index.html",
                 "design/protocol/index.html", "reliability/index.html",
                 "benchmarks/index.html", "differences/index.html"):
        assert (site / page).is_file(), page
    api = (site / "reference" / "joinkit" / "index.html").read_text()
    assert "notify_join_context" in api  # generated from the docstrings


@pytest.mark.launches
def test_the_site_fetches_nothing(site: Path) -> None:
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert "fonts.googleapis" not in text and "cdn.jsdelivr" not in text, html


@pytest.mark.launches
def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "RESULTS.md", copy / "benchmarks" / "RESULTS.md")
    page = copy / "docs" / "guide" / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    done = _build(copy, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


@pytest.mark.launches
def test_the_protocol_diagram_is_the_transition_table(site: Path) -> None:
    text = protocol.render()
    table = {
        (phase.name, observation.__name__): tuple(p.name for p in targets)
        for (phase, observation), (_, targets) in _machine.TRANSITIONS.items()
    }
    assert protocol.parse(text) == table
    for phase in _machine.Phase:  # every phase is drawn, the final ones too
        assert re.search(rf"^{phase.name}$", text, re.M), phase
    # every row of the table, with its handler, is on the built page
    page = (site / "design" / "protocol" / "index.html").read_text()
    for (_phase, _observation), (handler, _targets) in _machine.TRANSITIONS.items():
        assert handler.__name__ in page, handler.__name__
    assert protocol.MARKER not in page


def test_the_protocol_diagram_names_the_commands_a_handler_emits() -> None:
    rows = {(r[0], r[1]): r[4] for r in protocol.rows()}
    assert "CompareSignatures" in rows[("IDLE", "Entered")]
    assert "Drain" in rows[("ACTIVE", "LoopExited")]
    assert "RunPostHooks" in rows[("DRAINING", "Drained")]


def test_the_readme_is_a_short_front_page() -> None:
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) <= 10 * 1024, len(readme)
    lines = readme.decode().splitlines()
    # the quick start, for each audience, begins on the first screen
    assert lines.index("## Quick start") < 40
    audiences = ("**torch DDP.**", "**Lightning", "**A library author", "**An author of a new")
    for audience in audiences:
        assert any(line.startswith(audience) for line in lines), audience


def test_the_readme_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", readme, re.M)
    }
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (ROOT / path).exists(), target
        else:
            assert anchor in anchors, target


def test_the_nav_names_coming_pages_and_shows_them_once_they_exist(tmp_path: Path) -> None:
    import hooks

    nav = [{"Guide": [{"Data": "data.md"}, {"Typo": "typo.md"}, {"Quick": "quick.md"}]},
           {"Integrations": [{"Ray": "ray.md"}]}]
    coming = {"data.md", "ray.md"}
    # Missing coming pages go (a section left empty goes too); other entries stay,
    # so mkdocs --strict still fails on a typo.
    assert hooks._prune(nav, str(tmp_path), coming) == [
        {"Guide": [{"Typo": "typo.md"}, {"Quick": "quick.md"}]}
    ]
    (tmp_path / "data.md").write_text("# Data\n")
    assert hooks._prune(nav, str(tmp_path), coming)[0] == {
        "Guide": [{"Data": "data.md"}, {"Typo": "typo.md"}, {"Quick": "quick.md"}]
    }
