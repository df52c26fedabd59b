"""Every ```python block in README.md and docs/*.md runs as written.

A reader copies a snippet and expects it to work, so each block runs on its
own, in a fresh namespace, with nothing defined beforehand. Snippets build the
small synthetic installs they need in a temporary directory (float32 on the
CPU, like the rest of the suite).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A fence opening a Python block at the start of a line (possibly indented in a
# list), its body, and the closing fence at the same indent.
BLOCK = re.compile(r"^(?P<indent>[ \t]*)```python\n(?P<body>.*?)^(?P=indent)```$", re.M | re.S)


def snippets() -> list[pytest.param]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            indent = match.group("indent")
            body = "".join(
                row.removeprefix(indent) for row in match.group("body").splitlines(keepends=True)
            )
            name = f"{doc.relative_to(ROOT)}:{line}"
            found.append(pytest.param(name, body, id=name))
    return found


def test_the_docs_have_snippets() -> None:
    assert len(snippets()) >= 4, "README.md's Python API lost its snippets"


@pytest.mark.parametrize(("where", "code"), snippets())
def test_snippet_runs_as_written(
    where: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the snippet's installs go here
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__snippet__"})
