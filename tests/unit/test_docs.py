"""The README and docs/ stay true to the tree (issue 50): the README is a front door of at
most about 250 lines, the file tree lives in docs/ARCHITECTURE.md alone and names only
files that exist, and every relative link of the README and docs/ reaches a file.
(Their command lines are run by tests/e2e/test_readme.py.)"""

from __future__ import annotations

import re

from runs import REPO

ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PLACEHOLDERS = {"conf/<group>/*.yaml"}


def layout_entries() -> list[str]:
    """The paths docs/ARCHITECTURE.md's file tree names: a name indented by two spaces per
    level under the folder above it; `a, b` names two files; `make x` lines are targets."""
    text = ARCHITECTURE.read_text()
    block = text[text.index("## Layout") :]
    block = block[block.index("```\n") + 4 :]
    block = block[: block.index("```")]
    paths: list[str] = []
    folders: list[str] = []
    for line in block.splitlines():
        match = re.match(r"( *)(\S.*?)(?:\s{2,}|$)", line)
        if not match or len(match.group(1)) >= 20 or match.group(2).startswith("make "):
            continue  # a description's continuation, or a make target
        depth, name = len(match.group(1)) // 2, match.group(2)
        folders = folders[:depth]
        paths += ["/".join([*folders, part.split(" ")[0]]) for part in name.split(", ")]
        if name.endswith("/") and ", " not in name:
            folders.append(name.rstrip("/"))
    return paths


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines: move detail to docs/"
    assert not any(line.startswith("## Files") for line in lines), "the file tree lives in docs/ARCHITECTURE.md"


def test_every_path_of_the_file_tree_exists():
    paths = layout_entries()
    assert {"launcher/rank/loop.py", "engines/ddp/engine.py", "docs/runs.md", "tests/helpers/runs.py"} <= set(paths)
    missing = [p for p in paths if p not in PLACEHOLDERS and not list(REPO.glob(p))]
    assert not missing, f"docs/ARCHITECTURE.md's tree names what is not there: {missing}"


def test_every_relative_link_reaches_a_file():
    broken = [
        f"{page.relative_to(REPO)}: {target}"
        for page in PAGES
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text())
        if not target.startswith(("http://", "https://", "#")) and not (page.parent / target.split("#")[0]).exists()
    ]
    assert not broken, broken


def test_the_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
