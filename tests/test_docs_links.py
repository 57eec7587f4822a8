"""The docs stay true to the tree: every relative link in README.md and docs/ resolves (the file,
and the heading when the link names one), and the README's map names exactly the package's
top-level modules and folders, so neither can go stale unnoticed. Pure text, no process group."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hybridpar"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
MAP_ROW = re.compile(r"^\| `([\w.]+/?)` \|", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the text without markup, lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).replace("`", "").replace("*", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path`` (repeats numbered ``-1``, ``-2``, ... as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"^#{1,6} (.+)$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The relative links of ``path`` outside code blocks (not http(s), mail or absolute)."""
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:|^/", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path):
    """The checker itself: a link to a missing file or heading is reported, a good one not."""
    (tmp_path / "a.md").write_text("# Top\n## Some `code_name` heading: yes\n```\n[x](gone.md)\n```\n# Top\n")
    assert anchors(tmp_path / "a.md") == {"top", "some-code_name-heading-yes", "top-1"}
    (tmp_path / "b.md").write_text("[ok](a.md#some-code_name-heading-yes) [no](a.md#nope) [gone](c.md) [w](https://x.y)")
    assert links(tmp_path / "b.md") == ["a.md#some-code_name-heading-yes", "a.md#nope", "c.md"]


def test_readme_map_names_every_top_level_module():
    """The README's map (rows ``| `name` |`` or ``| `folder/` |``) lists exactly the package's
    top-level modules and folders: a new one must be placed there, a removed one leaves."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Map", 1)[1].split("\n## ", 1)[0]
    mapped = set(MAP_ROW.findall(section))
    present = {p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert mapped == present, f"README map: missing {sorted(present - mapped)}, stale {sorted(mapped - present)}"
