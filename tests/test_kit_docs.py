"""docs/KIT.md documents exactly the checks the conformance kit runs.

A family author reads that page to learn what a check proves, when it runs
and how to read its failure; a check added without a section, or a section
left behind by a removed check, would mislead them. The checks are the
``test_*`` methods :class:`~turbospark.conformance.FamilyConformance` exposes.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from turbospark.conformance import FamilyConformance

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "docs" / "KIT.md"
SECTION = re.compile(r"^### `(\w+)`$", re.M)


def kit_checks() -> list[str]:
    return sorted(n.removeprefix("test_") for n in dir(FamilyConformance) if n.startswith("test_"))


def documented() -> list[str]:
    return SECTION.findall(KIT.read_text())


def test_every_check_is_documented_once() -> None:
    names = documented()
    missing = sorted(set(kit_checks()) - set(names))
    assert not missing, f"checks without a section in docs/KIT.md: {missing}"
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"checks documented twice in docs/KIT.md: {repeated}"


def test_no_section_names_a_check_the_kit_lacks() -> None:
    extra = sorted(set(documented()) - set(kit_checks()))
    assert not extra, f"docs/KIT.md documents checks the kit lacks: {extra}"


def test_each_section_says_what_it_proves_when_it_runs_and_how_it_fails() -> None:
    text = KIT.read_text()
    starts = [m.start() for m in SECTION.finditer(text)] + [len(text)]
    incomplete = []
    for begin, end in itertools.pairwise(starts):
        section = text[begin:end]
        if not all(f"**{part}**" in section for part in ("Proves", "Runs", "Fails with")):
            incomplete.append(SECTION.match(section).group(1))
    assert not incomplete, f"sections lacking Proves / Runs / Fails with: {incomplete}"


def test_the_guide_and_the_readme_link_the_page() -> None:
    guide = ROOT / "examples" / "third_party_family" / "README.md"
    for page in (guide, ROOT / "README.md"):
        assert "docs/KIT.md" in page.read_text(), (
            f"{page.relative_to(ROOT)} does not link docs/KIT.md"
        )
