"""Every ``bench/...`` / ``docs/bench/...`` path named in the docs and tools, and
every ``#anchor`` a markdown link points at, exists.

    python tools/check_doc_links.py      # prints what is missing; exit status 1 if anything is

Paths are looked for in README.md, docs/*.md and tools/ (``*.py``, ``*.sh``). A
``docs/bench/...`` or ``tools/bench/...`` path is taken from the repository root;
a bare ``bench/...`` from the file's own folder (docs/ links), tools/ (the layout
in docs/architecture.md names ``bench/`` under ``tools/``) or docs/ (the page tools/bench
writes). Shell braces (``live-replay-{cpu,h200}.json``) are expanded. Anchors are checked against
GitHub's slugs of the target page's headings.
"""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = re.compile(r"(?<![\w/.-])((?:docs/|tools/)?bench/[\w.{},/*-]*)")
LINK = re.compile(r"\]\(([^)\s]*?)(#[^)\s]+)?\)")


def _expand(p: str) -> list[str]:
    """``a-{x,y}.json`` -> ``a-x.json``, ``a-y.json``."""
    parts = re.split(r"\{([^{}]*)\}", p)
    choices = [[s] if i % 2 == 0 else s.split(",") for i, s in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _exists(src: Path, p: str) -> bool:
    p = p.rstrip(".,")
    if "*" in p or p.endswith("/" + "DIR"):
        return True  # a pattern or a placeholder, not a file
    if p.startswith(("docs/", "tools/")):
        return (ROOT / p).exists()
    return any((d / p).exists() for d in (src.parent, ROOT / "tools", ROOT / "docs"))


def slugs(md: Path) -> set[str]:
    """GitHub's anchors of ``md``'s headings (duplicates numbered)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        s = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def main() -> int:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "tools").rglob("*.py")), *sorted((ROOT / "tools").glob("*.sh"))]
    bad = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        for m in PATH.finditer(text):
            for p in _expand(m.group(1)):
                if not _exists(f, p):
                    bad.append(f"{f.relative_to(ROOT)}: {p}")
        if f.suffix != ".md":
            continue
        for m in LINK.finditer(text):
            target, anchor = m.group(1), m.group(2)
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            page = (f.parent / target) if target else f
            if target and not page.exists():
                bad.append(f"{f.relative_to(ROOT)}: link {target}")
            elif anchor and page.suffix == ".md" and anchor[1:] not in slugs(page):
                bad.append(f"{f.relative_to(ROOT)}: anchor {target}{anchor}")
    for b in bad:
        print(b)
    print(f"{len(bad)} missing" if bad else "all doc paths and anchors exist")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
