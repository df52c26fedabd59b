"""bench/ab.py, the alternating-process A/B, against a recorded H200 run and a stand-in gpu.py.

The A/B itself runs only on a GPU machine; here its summary of a process is
checked against the summary recorded by hand for the same raw lines
(``bench/results/gpu/h200_s21_ab*.jsonl``), and a whole run drives a
stand-in ``gpu.py`` (a script that writes a recorded ``forward`` line and
the import roots it was given) through real subprocesses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu"
sys.path.insert(0, str(ROOT))
from bench import ab  # noqa: E402

sys.path.remove(str(ROOT))


def _forward_lines() -> list[dict]:
    lines = [json.loads(t) for t in (RESULTS / "h200_s21_ab_raw.jsonl").read_text().splitlines()]
    return [line for line in lines if line["piece"] == "forward"]


def test_the_summary_equals_the_recorded_one() -> None:
    recorded = [json.loads(t) for t in (RESULTS / "h200_s21_ab.jsonl").read_text().splitlines()]
    forward = _forward_lines()
    assert len(forward) == len(recorded) == 6
    for line, want in zip(forward, recorded, strict=True):
        got = ab.summarize(line)
        assert got is not None
        assert {k: v for k, v in want.items() if k != "process"} == got
    assert ab.summarize({"piece": "machine"}) is None


def test_the_plan_alternates_each_familys_trees() -> None:
    assert [t for _, t in ab.plan(4, ["gemma4"])] == ["new", "base", "new", "base"]
    assert ab.plan(4, ["qwen_gdn", "gemma4"]) == [
        ("qwen_gdn", "new"), ("gemma4", "new"), ("qwen_gdn", "base"), ("gemma4", "base"),
    ]  # fmt: skip


def test_a_run_alternates_trees_and_summarises_each_process(tmp_path: Path) -> None:
    """Three processes of a stand-in gpu.py: each gets its tree's packages
    first on its path and its own directory; the summary has one row each,
    in order, and the raw file every line."""
    base = tmp_path / "base"
    for name in ("core", "plugins/one"):
        (base / name).mkdir(parents=True)
    (base / "plugins" / "one" / "pyproject.toml").write_text("")
    line = _forward_lines()[0]
    gpu = tmp_path / "gpu.py"
    gpu.write_text(
        "import json, os, sys\n"
        "out = sys.argv[1]; os.makedirs(out)\n"
        f"line = {json.dumps(line)!r}\n"
        "first = os.environ['PYTHONPATH'].split(os.pathsep)[0]\n"
        "with open(os.path.join(out, 'gpu.jsonl'), 'w') as f:\n"
        "    f.write(json.dumps({'piece': 'machine', 'first': first}) + '\\n' + line + '\\n')\n"
    )
    out = tmp_path / "out"
    ab.run(out, base, ["gemma4"], 3, budget=120, gpu=gpu)
    rows = [json.loads(t) for t in (out / "summary.jsonl").read_text().splitlines()]
    assert [(r["process"], r["tree"]) for r in rows] == [(1, "new"), (2, "base"), (3, "new")]
    assert all(
        r == {**ab.summarize(line), "process": r["process"], "tree": r["tree"]} for r in rows
    )
    machines = [
        json.loads(t)["first"]
        for t in (out / "raw.jsonl").read_text().splitlines()
        if json.loads(t)["piece"] == "machine"
    ]
    assert machines == [str(ROOT / "core"), str(base / "core"), str(ROOT / "core")]
    with pytest.raises(SystemExit, match="exists"):
        ab.run(out, base, ["gemma4"], 1, budget=120, gpu=gpu)
