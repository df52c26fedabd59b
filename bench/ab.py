"""Two trees' decode on one GPU machine, in alternating processes: an A/B.

On the lent H200s the same code decodes up to 1.4x faster in one process
than in the next, and mlx-lm's rate moves with it (bench/README.md,
nineteenth to twenty-first sessions). So a change is read from adjacent
processes of the two trees and from each process's own ratio to mlx-lm,
never from one run each. This runs ``bench/gpu.py OUT --only forward`` in a
fresh process per row, alternating this tree with another one's packages
first on ``PYTHONPATH``, each into a directory of its own, and appends one
summary line per process (decode rates, ratio, roofline fraction, host
build µs, kernels) to ``summary.jsonl`` in OUT and the raw lines to
``raw.jsonl`` there. It stops before a process could overrun *budget*
seconds, since a device call has a time limit::

    python bench/ab.py export REV                  # here: REV's packages to .ab/REV
    python3 bench/ab.py run OUT --base .ab/REV [--family F ...] [--processes 6] [--budget 470]

``export`` writes ``core`` and ``plugins`` of git revision REV into
``.ab/REV``, which git ignores: name ``.ab`` in the device call's ``carry``. ``--family`` may repeat: the rows
cycle through the families, and each family alternates its trees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def packages(tree: Path) -> list[str]:
    """The import roots of a tree's packages: ``core`` and each plugin's directory."""
    plugins = sorted(p for p in (tree / "plugins").iterdir() if (p / "pyproject.toml").exists())
    return [str(tree / "core"), *map(str, plugins)]


def plan(processes: int, families: list[str]) -> list[tuple[str, str]]:
    """``(family, tree)`` for each process in order: families in turn, and
    each family's trees alternating, ``new`` first."""
    seen: dict[str, int] = {}
    rows = []
    for i in range(processes):
        family = families[i % len(families)]
        n = seen[family] = seen.get(family, -1) + 1
        rows.append((family, "new" if n % 2 == 0 else "base"))
    return rows


def summarize(line: dict[str, Any]) -> dict[str, Any] | None:
    """One process's ``forward`` line of ``gpu.jsonl`` as a summary row, or
    None for any other piece: the library loops' decode rates and their
    ratio, our fraction of the bandwidth roofline, the hand loops, the
    measured copy rate, each engine's host µs to build a step and our kernels."""
    if line.get("piece") != "forward":
        return None
    result = line["result"]
    engines, cost = result["engines"], result["step_cost"]
    return {
        "family": line["family"],
        "ours_generate": round(engines["ours_generate"]["decode_tok_s"], 1),
        "mlx_lm_generate_step": round(engines["mlx_lm_generate_step"]["decode_tok_s"], 1),
        "ratio": round(result["generate_decode_ratio_vs_mlx_lm"], 3),
        "roofline_ours_generate": round(result["roofline"]["fraction"]["ours_generate"], 4),
        "hand_ours": round(engines["ours"]["decode_tok_s"], 1),
        "hand_mlx_lm": round(engines["mlx_lm"]["decode_tok_s"], 1),
        "copy_TBps": round(result["roofline"]["copy_bytes_per_s"] / 1e12, 3),
        "seconds": round(line["seconds"]),
        "host_us_ours": round(cost["ours"]["host_us_per_step"], 1),
        "kernels_ours": cost["ours"]["kernels"],
        "primitives_ours": cost["ours"]["primitives"],
        "host_us_mlx_lm": round(cost["mlx_lm"]["host_us_per_step"], 1),
    }


def run(
    out: Path,
    base: Path,
    families: list[str],
    processes: int,
    budget: float,
    gpu: Path = ROOT / "bench" / "gpu.py",
) -> None:
    """The A/B (module docstring), each process running *gpu*; prints each
    summary row as it lands."""
    out.mkdir(parents=True, exist_ok=True)
    trees = {"new": packages(ROOT), "base": packages(base.resolve())}
    started = time.monotonic()
    longest = 0.0
    for i, (family, tree) in enumerate(plan(processes, families), 1):
        left = budget - (time.monotonic() - started)
        if left < longest:  # the next process might not finish
            print(f"stopped before process {i}: {left:.0f} s left", flush=True)
            return
        rows_dir = out / f"p{i}_{family}_{tree}"
        if rows_dir.exists():
            raise SystemExit(f"{rows_dir} exists: give the A/B an empty OUT")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*trees[tree], env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        command = [sys.executable, str(gpu), str(rows_dir), "--family", family, "--only", "forward"]
        began = time.monotonic()
        try:
            done = subprocess.run(
                command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=max(left, 1)
            )
        except subprocess.TimeoutExpired:
            print(f"process {i} ({family}, {tree}) ran past the budget", flush=True)
            return
        longest = max(longest, time.monotonic() - began)
        (rows_dir / "log.txt").write_text(done.stdout[-4000:] + done.stderr[-4000:])
        lines = [
            json.loads(text)
            for path in sorted(rows_dir.glob("*.jsonl"))
            for text in path.read_text().splitlines()
        ]
        with (out / "raw.jsonl").open("a") as raw:
            raw.writelines(json.dumps(line) + "\n" for line in lines)
        for line in lines:
            row = summarize(line)
            if row is not None:
                row = {"process": i, "tree": tree, **row}
                with (out / "summary.jsonl").open("a") as summary:
                    summary.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
        if done.returncode:
            print(f"process {i} ({family}, {tree}) exited {done.returncode}", flush=True)


def export(rev: str) -> Path:
    """REV's ``core`` and ``plugins`` in ``.ab/REV``."""
    target = ROOT / ".ab" / rev
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "archive", rev, "core", "plugins"], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="a git revision's packages into .ab/REV")
    exporting.add_argument("rev")
    running = commands.add_parser("run", help="the A/B, on the GPU machine")
    running.add_argument("out", type=Path)
    running.add_argument("--base", type=Path, required=True, help="the other tree (.ab/REV)")
    running.add_argument("--family", action="append", choices=["gemma4", "qwen_gdn"])
    running.add_argument("--processes", type=int, default=6)
    running.add_argument("--budget", type=float, default=470, help="seconds for the whole run")
    args = parser.parse_args()
    if args.command == "export":
        print(export(args.rev))
        return
    run(args.out, args.base, args.family or ["gemma4"], args.processes, args.budget)


if __name__ == "__main__":
    main()
