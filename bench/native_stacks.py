"""Where a thread's host time goes below Python: native stacks sampled with py-spy.

On the H200 a batched prefill forward takes 36-38 ms longer the first time its
shape runs, and ``bench/device_trace.py`` put only ~8 ms of that in CUDA's
runtime and driver calls: the rest is host time inside MLX's C++ or a library
it calls (cuBLASLt's algorithm selection is the first suspect). Python
profilers stop at the extension's boundary; ``py-spy record --native`` walks
into it. This runs forwards for ``--seconds`` while py-spy samples this very
process, then ranks what the samples of the timed forwards were in (those of
feeding each row's earlier tokens are left out; :func:`summarise`):

- ``by_library``: each sample's innermost frame's library (``libmlx.so``,
  ``libcublasLt.so.13``, ``libcuda.so.1``, the interpreter);
- ``top_self``: innermost named frames; ``top_inclusive``: named frames
  anywhere on the stack (a function counted once a sample).

Two workloads, to tell what a new shape costs from what any forward does:

- ``new``: every forward a shape this process has not run (rows 2-5, new
  tokens rising by one from 100, 80-230 held), as a server's prefill groups;
- ``again``: one shape over and over.

py-spy is an executable, not a library (``pip install py-spy``; carry its
wheel to the GPU machine); ``--py-spy`` names it when it is not on ``PATH``.

Run: ``python3 bench/native_stacks.py new --family gemma4 --size chat_large
--dtype bfloat16 --seconds 20 [--json]``, then ``again`` the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_FRAME = re.compile(r"^(?P<name>.*?) \((?P<where>[^()]*)\)$")


def _split(frame: str) -> tuple[str, str]:
    """``"mlx::core::eval (libmlx.so)"`` -> (name, library); a bare address
    keeps its library and reads as unnamed (``"0x7f.."``)."""
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip(), "?"
    where = match["where"]
    library = where if ".so" in where or where.startswith("lib") else "python"
    return match["name"], library


def summarise(
    raw: str, top: int = 25, within: str | None = None, outside: str | None = None
) -> dict[str, Any]:
    """Rank py-spy's raw output (``frame;frame;... count`` a line, outermost
    first), keeping only samples with a frame named *within* on their stack
    and none named *outside* (``None``: no condition)."""
    by_library: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    samples = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_split(frame) for frame in stack.split(";")]
        names = {f for f, _ in frames}
        if (within is not None and within not in names) or outside in names:
            continue
        samples += n
        name, library = frames[-1]
        by_library[library] += n
        if not name.startswith("0x"):
            own[f"{name} ({library})"] += n
        for named in {f"{f} ({lib})" for f, lib in frames if not f.startswith("0x")}:
            inclusive[named] += n
    return {
        "samples": samples,
        "by_library": dict(by_library.most_common()),
        "top_self": own.most_common(top),
        "top_inclusive": inclusive.most_common(top),
    }


def _shapes(workload: str) -> Any:
    """(rows, new tokens, held) forever: each new, or one repeated."""
    if workload == "again":
        while True:
            yield 3, 145, 80
    tokens = 100
    while True:
        for rows in (2, 3, 4, 5):
            yield rows, tokens, 80 + (tokens * 7) % 150
        tokens += 1


def sample(path: Path, workload: str, seconds: float, rate: int, spy: str) -> dict[str, Any]:
    """Forwards of *workload* for *seconds* while py-spy samples this process."""
    import numpy as np

    from bench.prefill_cost import timed_forward
    from turbospark.generation.runner import Runner

    runner = Runner.open(path, context_length=4096, session_slots=16)
    rng = np.random.default_rng(0)
    timed_forward(runner, rng, 1, 8, 0)  # the process's own first forward (its compiles)
    timed_forward(runner, rng, 3, 145, 80)  # the repeated shape's first time, outside
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stacks.txt"
        command = [spy, "record", "--native", "--pid", str(os.getpid()), "--rate", str(rate),
                   "--duration", str(int(seconds)), "--format", "raw", "--output", str(out)]  # fmt: skip
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        ms, shapes = [], _shapes(workload)
        began = time.perf_counter()
        while recorder.poll() is None and time.perf_counter() - began < seconds + 30:
            ms.append(timed_forward(runner, rng, *next(shapes)))
        _, error = recorder.communicate(timeout=60)
        if recorder.returncode != 0 or not out.is_file():
            raise RuntimeError(f"py-spy failed ({recorder.returncode}): {error.decode()[-300:]}")
        # The timed forward only: its sessions' earlier tokens are fed in held_group.
        result = summarise(out.read_text(), within="timed_forward", outside="held_group")
    runner.close()
    ms.sort()
    result.update(workload=workload, forwards=len(ms), median_ms=round(ms[len(ms) // 2], 2))
    return result


def main() -> None:
    from bench.common import DEFAULT_CACHE, FAMILIES, default_dtype, install

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=["new", "again"])
    parser.add_argument("--family", choices=FAMILIES, default="gemma4")
    parser.add_argument("--size", default="chat_large")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=200, help="samples a second")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    path = install(args.family, args.size, args.dtype or default_dtype(), args.cache_dir)
    result = sample(path, args.workload, args.seconds, args.rate, args.py_spy)
    if args.json:
        print(json.dumps({"piece": "native_stacks", "family": args.family, **result}))
        return
    print(f"{args.workload}: {result['forwards']} forwards, median {result['median_ms']} ms, "
          f"{result['samples']} samples")  # fmt: skip
    for library, n in result["by_library"].items():
        print(f"  {n / result['samples']:6.1%}  {library}")
    for title in ("top_self", "top_inclusive"):
        print(f" {title}:")
        for name, n in result[title]:
            print(f"  {n / result['samples']:6.1%}  {name[:110]}")


if __name__ == "__main__":
    main()
