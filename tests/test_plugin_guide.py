"""The plugin author's guide lists exactly the hooks the contract declares.

``examples/third_party_family/README.md`` is where a family author learns the
contract, so its hook table must name every hookspec, in the contract's
order, and its count must be the contract's count. The hookspecs are read
through pluggy from the module that defines the public ``ArchConfig`` (the
contract module), so the test follows the contract wherever it lives.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pluggy

import turbospark

GUIDE = Path(__file__).resolve().parents[1] / "examples" / "third_party_family" / "README.md"
HOOK_ROW = re.compile(r"^\| `(turbospark_\w+)\(", re.M)
COUNT = re.compile(r"There are (\w+)(?: hooks)?[:;,]")
NUMBERS = {
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
}  # fmt: skip


def declared_hooks() -> list[str]:
    """The contract's hookspecs, in the order the module declares them."""
    contract = importlib.import_module(turbospark.ArchConfig.__module__)
    pm = pluggy.PluginManager("turbospark")
    names = [
        name
        for name, value in vars(contract).items()
        if inspect.isfunction(value) and pm.parse_hookspec_opts(contract, name) is not None
    ]
    assert names, f"no hookspecs found in {contract.__name__}"
    return names


def test_the_guide_lists_every_hook_in_the_contracts_order() -> None:
    listed = HOOK_ROW.findall(GUIDE.read_text())
    assert listed == declared_hooks()


def test_the_guide_counts_the_hooks() -> None:
    said = COUNT.search(GUIDE.read_text())
    assert said, "the guide no longer says how many hooks there are"
    assert NUMBERS.get(said.group(1).lower()) == len(declared_hooks())
