"""``turbospark conformance FAMILY``: the conformance kit from the command line."""

from __future__ import annotations

import argparse
import textwrap
from typing import TYPE_CHECKING

from turbospark.commands import add_quantize_flags, quantize_spec
from turbospark.errors import TurbosparkError

if TYPE_CHECKING:  # pytest and hypothesis load in run(): they are the conformance extra's
    from turbospark.conformance.run import KitReport

MARKS = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP", "error": "ERROR"}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "conformance",
        help="run the conformance kit against an installed family",
        description="Run every conformance check the family's declared capabilities call for "
        "(session pool, reuse, vision taint, rewind, snapshots, nbytes) on a synthetic install "
        "built by the family's own hook. Exit status 0 when every check passed or was skipped.",
    )
    parser.add_argument("family", help="the family name, as `turbospark families` lists it")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument(
        "--examples",
        type=positive,
        metavar="N",
        help="hypothesis schedules per interleaving check (default 15)",
    )
    add_quantize_flags(parser, "run the kit on a synthetic install")
    parser.set_defaults(func=run)


def positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return int(value)


def run(args: argparse.Namespace) -> int:
    try:
        from turbospark.conformance.run import run_kit
    except ImportError as exc:  # the core without its conformance extra
        raise TurbosparkError(str(exc)) from None

    report = run_kit(args.family, examples=args.examples, quantize=quantize_spec(args))
    print(report.model_dump_json(indent=2) if args.json else render(report))
    return 0 if report.passed else 1


def render(report: KitReport) -> str:
    packed = "" if report.quantization is None else f", {report.quantization}"
    lines = [f"conformance of family '{report.family}' ({report.source}{packed})"]
    for check in report.checks:
        lines.append(f"  {MARKS[check.outcome]:<5} {check.check}")
        if check.detail:
            reason = check.detail if check.outcome != "skipped" else f"skipped: {check.detail}"
            lines.append(textwrap.indent(reason, " " * 10))
    counts = ", ".join(f"{n} {o}" for o, n in report.counts.items() if n)
    lines.append(f"{'PASSED' if report.passed else 'FAILED'}: {counts or 'no checks ran'}")
    if report.pytest_output and not report.checks:
        lines.append(report.pytest_output)
    return "\n".join(lines)
