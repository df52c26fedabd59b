"""Where a fresh process's open and engine warm-up go, with the kernel caches empty, then kept.

A server's first launch on a machine compiles MLX's kernels (JIT, NVRTC on
CUDA) and ours (:mod:`turbospark.layers.cuda.kernel`); later launches find
both kept under the cache directory. This runs what a server runs before it
serves, in a fresh process an install: ``Runner.open`` (its warm-up traces
and evaluates a short prompt and a decode step) and ``Engine.warm_up`` at 16
rows, each engine phase timed to its end (``mx.synchronize``): the prefill
phases and the decode phases by batch size. Per install, reported:

- ``open_s``, ``warm_up_s`` and ``phases`` (seconds summed per phase, with
  how many steps ran it);
- ``our_compiles``: our kernels NVRTC compiled (count, and seconds summed
  over the threads that compiled them, from before the open);
- ``kernels``: the files each cache directory holds after the run
  (``turbospark``: our cubins; ``mlx``: MLX's compiled modules, and
  ``mlx_entries``, their names), so two installs' compile work can be told apart.

Each install gets its own empty cache directories (``TURBOSPARK_CACHE`` and
``MLX_PTX_CACHE_DIR``) for its ``first`` run; its ``kept`` run reuses them.
With ``--mlx-lm``, mlx-lm's ``load`` and its first and second ``generate``
(16 tokens) of the first quantized install, in a fresh process with its own
empty MLX cache. Meant for a GPU machine, where the compiles are; it runs
the same on the CPU.

Run: ``python -m bench.first_launch --family gemma4 --size large [--bits 4 --bits 0] [--mlx-lm] [--json]``
(``--bits 0``: the float install itself).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = 16  # the server's default batch: its warm-up decodes at every size up to it
PROMPT = list(range(3, 200))  # the warm-up's long prompt (the engine takes its first ids too)
RUNS = ("first", "kept")


def _child(path: Path) -> dict[str, Any]:
    """The open and warm-up of *path* in this process (see the module docstring)."""
    started = time.perf_counter()
    import mlx.core as mx

    from bench.step_cost import _engine
    from turbospark.generation.engine import Engine
    from turbospark.layers.cuda import nvrtc

    compiled: list[float] = []
    compile_cubin = nvrtc.compile_cubin

    def timed_compile(source: str, name: str, arch: str) -> bytes:
        began = time.perf_counter()
        try:
            return compile_cubin(source, name, arch)
        finally:
            compiled.append(time.perf_counter() - began)

    nvrtc.compile_cubin = timed_compile
    engine, runner = _engine(path, ROWS)
    opened = time.perf_counter()
    phases: dict[str, list[float]] = {}
    for method in ("_prefill", "_decode"):
        real = getattr(Engine, method)

        def timed(self: Engine, _real: Any = real, _method: str = method) -> Any:
            rows = len(self._batch.rows)
            began = time.perf_counter()
            out = _real(self)
            mx.synchronize()
            name = "prefill" if _method == "_prefill" else f"decode B={rows}"
            phase = phases.setdefault(name, [0, 0.0])
            phase[0] += 1
            phase[1] += time.perf_counter() - began
            return out

        setattr(Engine, method, timed)
    engine.warm_up(PROMPT, ROWS)
    mx.synchronize()
    runner.close()
    return {
        "open_s": round(opened - started, 2),
        "warm_up_s": round(time.perf_counter() - opened, 2),
        "phases": {
            name: {"steps": n, "s": round(s, 2)}
            for name, (n, s) in sorted(phases.items(), key=lambda kv: _order(kv[0]))
        },
        "our_compiles": {"count": len(compiled), "s": round(sum(compiled), 2)},
    }


def _order(phase: str) -> tuple[int, int]:
    """Prefill first, then the decode phases by batch size."""
    return (0, 0) if phase == "prefill" else (1, int(phase.rsplit("=", 1)[1]))


def _mlx_lm_child(path: Path) -> dict[str, Any]:
    started = time.perf_counter()
    from mlx_lm import generate, load

    model, tokenizer = load(str(path))
    loaded = time.perf_counter()
    generate(model, tokenizer, prompt=PROMPT, max_tokens=16)
    first = time.perf_counter()
    generate(model, tokenizer, prompt=[5, *PROMPT], max_tokens=16)
    return {
        "load_s": round(loaded - started, 2),
        "first_generate_s": round(first - loaded, 2),
        "second_generate_s": round(time.perf_counter() - first, 2),
    }


def _files(root: Path) -> dict[str, Any]:
    """Files under each cache: ours (``kernels/turbospark-*``) and MLX's, and
    the names of MLX's entries (a compiled module's names its ops), cut to
    100 characters, so which of MLX's kernels an install compiled can be read."""
    ours = [p for d in (root / "kernels").glob("turbospark-*") for p in d.iterdir()]
    mlx = root / "mlx"
    return {
        "turbospark": len(ours),
        "mlx": sum(1 for p in mlx.rglob("*") if p.is_file()),
        "mlx_entries": sorted(p.name[:100] for p in mlx.iterdir()) if mlx.is_dir() else [],
    }


def _run(mode: str, path: Path, root: Path, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "TURBOSPARK_CACHE": str(root), "MLX_PTX_CACHE_DIR": str(root / "mlx")}
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "bench.first_launch", f"--{mode}", str(path)],
        env=env, capture_output=True, text=True, timeout=timeout,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{mode} of {path} failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["process_s"] = round(time.perf_counter() - began, 2)
    out["kernels"] = _files(root)
    return out


def first_launch(
    installs: dict[str, Path], mlx_lm: Path | None = None, timeout: float = 600
) -> dict[str, Any]:
    """Each install's ``first`` and ``kept`` runs (and mlx-lm's of *mlx_lm*), by label."""
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for label, path in installs.items():
            root = Path(scratch) / label
            result[label] = {run: _run("child", path, root, timeout) for run in RUNS}
        if mlx_lm is not None:
            result["mlx_lm"] = _run("mlx-lm-child", mlx_lm, Path(scratch) / "mlx_lm", timeout)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gemma4")
    parser.add_argument("--size", default="large")
    parser.add_argument("--dtype", default=None, help="the float install's (default: the device's)")
    parser.add_argument(
        "--bits", type=int, action="append", help="repeatable; 0 is the float install (default 4 0)"
    )
    parser.add_argument("--mlx-lm", action="store_true", help="mlx-lm's load and first generates")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a process")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mlx-lm-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child or args.mlx_lm_child:
        out = _child(args.child) if args.child else _mlx_lm_child(args.mlx_lm_child)
        print(json.dumps(out), flush=True)
        return
    from bench.common import DEFAULT_CACHE, default_dtype, install, machine
    from bench.quantized import converted

    bits = args.bits or [4, 0]
    if any(b not in (0, 4, 8) for b in bits):
        parser.error("--bits takes 4, 8 or 0 (the float install)")
    base = install(args.family, args.size, args.dtype or default_dtype(), DEFAULT_CACHE)
    installs = {
        ("float" if b == 0 else f"q{b}"): base if b == 0 else converted(base, b) for b in bits
    }
    quantized = next((p for label, p in installs.items() if label != "float"), None)
    result = first_launch(installs, quantized if args.mlx_lm else None, args.timeout)
    if args.json:
        print(json.dumps({"machine": machine(), "size": args.size, "result": result}, indent=2))
        return
    for label, runs in result.items():
        for run, row in [("first", runs)] if label == "mlx_lm" else runs.items():
            shown = {k: v for k, v in row.items() if k != "phases"}
            if "kernels" in shown:  # the entries' names are for --json
                shown["kernels"] = {k: v for k, v in shown["kernels"].items() if k != "mlx_entries"}
            detail = ", ".join(f"{k} {v}" for k, v in shown.items())
            print(f"{label} {run}: {detail}")
            if "phases" in row:
                print(
                    "  "
                    + "; ".join(f"{k}: {v['steps']}x {v['s']} s" for k, v in row["phases"].items())
                )


if __name__ == "__main__":
    main()
