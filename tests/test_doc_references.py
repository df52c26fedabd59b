"""Every file a README, doc or docstring names exists in the repository.

A reference is a path with a ``/`` or a ``*.md`` name, ending in a source,
doc or data extension (``docs/SEMANTICS.md``, ``bench/results/cpu/forward_gemma4.json``,
``core/turbospark/contract/hookspecs.py``). It resolves against the repository root,
the naming file's folder, or one or two folders down (``turbospark/state/components.py``
inside ``core/``), with ``*`` as a glob.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"(?<![\w/.*-])((?:[\w.*-]+/)*[\w.*-]+\.(?:md|py|jsonl?|txt|toml))\b")


def tracked(*patterns: str) -> list[str]:
    done = subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip("not a git checkout")
    return done.stdout.split()


def resolves(reference: str, where: Path) -> bool:
    bases = [ROOT, where, *ROOT.glob("*"), *ROOT.glob("*/*")]
    return any(any(base.glob(reference)) for base in bases if base.is_dir())


def test_every_named_file_exists() -> None:
    missing = []
    for name in tracked("*.py", "*.md", "*.toml"):
        file = ROOT / name
        for match in REFERENCE.finditer(file.read_text()):
            reference = match.group(1)
            if "/" not in reference and not reference.endswith(".md"):
                continue  # a bare file name (config.json, state.py) is not a path
            if not resolves(reference, file.parent):
                missing.append(f"{name}: {reference}")
    assert not missing, "references to files the repository lacks:\n" + "\n".join(missing)
