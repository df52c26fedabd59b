"""The layout holds: each part imports only the parts below it, nothing imports in a cycle,
and families import only :mod:`turbospark.sdk`.

docs/ARCHITECTURE.md draws the parts and the arrows :data:`RANKS` allows. Every import
counts, including those inside functions and under ``TYPE_CHECKING``: an import deferred
into a function still ties the two modules together.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "turbospark"

# A module may import its own part and any part of a lower rank, never one of its rank or above.
RANKS = {
    "errors": 0,
    "paths": 0,
    "state": 1,
    "contract": 2,
    "text": 2,
    "layers": 3,
    "loading": 4,
    "policies": 4,
    "sessions": 5,
    "generation": 6,
    "conformance": 7,
    "server": 7,
    "commands": 8,
    "cli": 9,
}
# Entry points and the two public surfaces: they may import anything; nothing inside imports them.
SURFACES = {"turbospark", "turbospark.__main__", "turbospark.sdk"}
# What a family's own tests may import besides the SDK: the application API and the kit.
FAMILY_TEST_IMPORTS = {"turbospark.sdk", "turbospark", "turbospark.conformance"}


def module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every turbospark import in *path*, at any depth. ``from X import y``
    counts as importing ``X.y`` when that is a module, so a package's submodules are seen."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield node.lineno, sub if sub in MODULES else node.module


SOURCES = {module_name(p): p for p in sorted(CORE.rglob("*.py"))}
MODULES = set(SOURCES)


def part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in SOURCES.items():
        for _, target in imports(path):
            if target in MODULES and target != module and target not in SURFACES:
                graph[module].add(target)
    return graph


@pytest.mark.parametrize("module", sorted(MODULES - SURFACES))
def test_imports_only_lower_parts(module: str) -> None:
    mine = part(module)
    assert mine in RANKS, (
        f"{module}: part {mine!r} has no rank; add it to RANKS and ARCHITECTURE.md"
    )
    wrong = []
    for line, target in imports(SOURCES[module]):
        if not target.startswith("turbospark") or target.startswith("turbospark_"):
            continue
        if target in SURFACES:
            wrong.append(f"line {line}: {target} is a public surface, not for use inside")
            continue
        theirs = part(target)
        if theirs != mine and RANKS.get(theirs, 99) >= RANKS[mine]:
            wrong.append(
                f"line {line}: {mine} (rank {RANKS[mine]}) imports {target} (rank {RANKS.get(theirs)})"
            )
    assert not wrong, f"{module}:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = edges()
    cycles = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


FAMILY_FILES = sorted(
    p
    for top in (ROOT / "plugins", ROOT / "examples")
    for p in top.rglob("*.py")
    if ".venv" not in p.parts
)


@pytest.mark.parametrize("path", FAMILY_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_families_import_only_the_sdk(path: Path) -> None:
    allowed = FAMILY_TEST_IMPORTS if "tests" in path.parts else {"turbospark.sdk"}
    wrong = [
        f"line {line}: {target}"
        for line, target in imports(path)
        if target.split(".")[0] == "turbospark" and target not in allowed
    ]
    assert not wrong, f"{path.relative_to(ROOT)} imports turbospark internals:\n" + "\n".join(wrong)


def test_every_test_file_is_in_the_index() -> None:
    """docs/ARCHITECTURE.md says where each part's tests are: every tests/test_*.py
    matches one of its patterns, and every pattern matches a file."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Where the tests are") :]
    rows = [line.split("|") for line in section.splitlines() if line.startswith("| `")]
    patterns = [p for row in rows for p in re.findall(r"`([^`]+\.py)`", row[2])]
    files = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    unindexed = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    stale = [p for p in patterns if not any(fnmatch.fnmatch(f, p) for f in files)]
    assert not unindexed and not stale, f"not in the index: {unindexed}; matching nothing: {stale}"
