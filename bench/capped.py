"""Run a Python module as ``python -m`` would, with MLX's buffer cache bounded first.

    python -m bench.capped --cache-limit 8GiB -m mlx_lm.server --model DIR ...

MLX keeps freed buffers for reuse up to its cache limit, which defaults to its
memory limit (about the whole device). Two servers on one GPU would each take
the device as theirs, and the one whose batch shapes change every step fills
it. ``mlx_lm.server`` has no flag for the bound, so the benchmarks start it
through this launcher; they start ``turbospark serve`` through it too rather
than through its ``--mlx-cache-limit``, so that both servers get the bound the
same way, at the same moment (before the module is imported), and pay the same
launch cost in the start-up comparison.
"""

from __future__ import annotations

import argparse
import runpy
import sys

import mlx.core as mx

from turbospark.commands import byte_size


def main(argv: list[str]) -> None:
    """Everything after ``-m MODULE`` is the module's, passed on untouched (so no
    flag of ours can capture one of its flags)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.capped",
        usage="python -m bench.capped --cache-limit SIZE -m MODULE [ARG ...]",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--cache-limit",
        type=byte_size,
        required=True,
        metavar="SIZE",
        help="MLX's buffer cache limit (e.g. 8GiB; 0 keeps no freed buffers)",
    )
    if "-m" not in argv or argv.index("-m") == len(argv) - 1:
        parser.error("name the module to run: -m MODULE [ARG ...]")
    at = argv.index("-m")
    args = parser.parse_args(argv[:at])
    module, rest = argv[at + 1], argv[at + 2 :]
    mx.set_cache_limit(args.cache_limit)
    sys.argv = [module, *rest]  # as ``python -m MODULE ARG ...`` would see them
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
