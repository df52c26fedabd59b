"""No progress-log markers in the repository: history belongs to git.

Docs, comments and file names say what is true now and why. A marker of when
something was done (a run or session ordinal, an issue number, a commit sha, a
``_run2``/``_after1`` file tag) dates the text and means nothing to a reader
who was not there. Ordinary English stays allowed: "first", "second", "third"
and "every fourth layer" are not flagged; ordinals from eleventh on, and
fourth to tenth next to run/session/round/pass, are.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Machine-written files whose hex strings are hashes, not commits; and this
# file, whose examples are markers on purpose.
NOT_CHECKED = ["uv.lock", "tests/test_no_progress_markers.py"]

_LATE = (
    r"eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth"
    r"|nineteenth|twentieth|thirtieth|fortieth"
    r"|(?:twenty|thirty|forty)-?(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
)
_MIDDLE = r"fourth|fifth|sixth|seventh|eighth|ninth|tenth"
_SESSIONISH = r"runs?|sessions?|rounds?|pass(?:es)?|reviews?|attempts?|iterations?"
_HEX = r"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}"

# What a line of text may not say.
TEXT_MARKERS = {
    "an ordinal past the tenth (a run name)": re.compile(rf"\b(?:{_LATE})\b", re.I),
    "an ordinal run/session name": re.compile(rf"\b(?:{_MIDDLE})[ -](?:{_SESSIONISH})\b", re.I),
    "a numbered run": re.compile(
        r"\brun[ _-]?#?\d+\b(?!\s*(?:times|ranks|processes|replicas|requests|steps|layers))",
        re.I,
    ),
    "a before/after tag": re.compile(r"\w_(?:after|before)\d+\b", re.I),
    "an issue or pull request number": re.compile(r"\b(?:issues?|PR|pull request)\s*#?\d+\b", re.I),
    # Not a CSS colour (``color: #333``), an HTML entity or a Markdown anchor.
    "a #number in prose": re.compile(r"(?<![\w&#/(\[:])(?<!: )#\d+\b(?![0-9a-fA-F])"),
    "a branch tip": re.compile(r"\bmain at\b", re.I),
    "a commit sha": re.compile(rf"\b(?:commit|sha|at)\s+`?{_HEX}\b"),
    "a section named after the seed's history": re.compile(r"\bbeyond the seed\b", re.I),
}
# Prose (Markdown) may not carry a bare sha either.
BARE_SHA = re.compile(rf"(?<![\w.+/-]){_HEX}(?![\w.-])")
# What a tracked path may not be called.
NAME_MARKERS = re.compile(
    rf"(?:^|[/_.-])(?:run\d+|(?:after|before)\d*|s\d+|b\d+|{_LATE}|{_MIDDLE})(?=$|[/_.-])", re.I
)


def tracked() -> list[str]:
    done = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip("not a git checkout")
    return done.stdout.splitlines()


def text_of(name: str) -> str | None:
    """The file's text, or None for a binary file (weights, images)."""
    data = (ROOT / name).read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def markers_in(name: str, text: str, prose: bool) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in TEXT_MARKERS.items():
            if match := pattern.search(line):
                found.append(f"{name}:{number}: {what}: {match.group(0)!r}")
        if prose and (match := BARE_SHA.search(line)):
            found.append(f"{name}:{number}: a commit sha: {match.group(0)!r}")
    return found


def test_no_file_carries_a_progress_marker() -> None:
    found = []
    for name in tracked():
        if name in NOT_CHECKED or (text := text_of(name)) is None:
            continue
        found += markers_in(name, text, prose=name.endswith(".md"))
    assert not found, "progress-log markers (say what is true now, and why):\n" + "\n".join(found)


def test_no_file_name_carries_a_progress_marker() -> None:
    found = [name for name in tracked() if NAME_MARKERS.search(name)]
    assert not found, "file names tagged with a run, session or before/after:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "measured in the twenty-third session",
        "bench/README's sixteenth-session trace",
        "the fifth run of the day",
        "(bench/README.md, run 10)",
        "see bench/README's #10",
        "Issue 12 asked to choose",
        "on main at 1a2b3c4",
        "fixed in commit 0123abcd",
        "## Beyond the seed: checkpoints",
        "concurrency_cpu_s15_after1.json",
    ],
)
def test_markers_are_caught(line: str) -> None:
    assert markers_in("example", line, prose=True) or NAME_MARKERS.search(line)


@pytest.mark.parametrize(
    "line",
    [
        "the first session's state bytes",
        "an unrelated third session",
        "the head's first round misses",
        "Layers 0-2 gated DeltaNet, layer 3 full attention (every fourth)",
        "about a tenth of its time",
        "session 1 leaves, copied back out",
        "color: #333; background: #fff0f0",
        "see [the rules](#the-prefix-record)",
        "a sha256 of every file",
        "1.89352455891786e-01",
        "runs 2 ranks; mlx.launch -n 2",
    ],
)
def test_ordinary_english_passes(line: str) -> None:
    assert not markers_in("example", line, prose=True)
