"""Run the kit outside a test suite: what ``turbospark conformance FAMILY`` does.

It writes a one-class test module for the family into a scratch directory,
runs pytest on it in-process with an empty config (the caller's pytest
settings must not change the verdict), and collects one result per check
through a tiny pytest plugin. pytest's own output is kept for when pytest
itself could not run.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from turbospark.conformance.kit import EXAMPLES_ENV
from turbospark.loading.plugins import default_registry
from turbospark.loading.quantization import QuantSpec

Outcome = Literal["passed", "failed", "skipped", "error"]

MODULE = """\
from turbospark.conformance import FamilyConformance
from turbospark.loading.quantization import QuantSpec


class TestConformance(FamilyConformance):
    family = {family!r}
    quantize = {quantize}
"""


class CheckResult(BaseModel):
    check: str
    outcome: Outcome
    detail: str = ""


class KitReport(BaseModel):
    family: str
    quantization: str | None = None
    source: str
    passed: bool
    counts: dict[str, int]
    checks: list[CheckResult]
    pytest_output: str = ""


class _Collector:
    """Records each check's outcome, with the skip reason or failure message."""

    def __init__(self) -> None:
        self.results: dict[str, CheckResult] = {}

    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> None:
        name = item.name.removeprefix("test_")
        if call.excinfo is None:
            if call.when == "call":
                self.results[name] = CheckResult(check=name, outcome="passed")
            return
        error = call.excinfo.value
        if isinstance(error, pytest.skip.Exception):
            self.results[name] = CheckResult(check=name, outcome="skipped", detail=error.msg)
        elif call.when == "call":
            self.results[name] = CheckResult(check=name, outcome="failed", detail=str(error))
        else:
            detail = f"{call.when} failed: {type(error).__name__}: {error}"
            self.results[name] = CheckResult(check=name, outcome="error", detail=detail)


@contextlib.contextmanager
def _examples(examples: int | None) -> Iterator[None]:
    previous = os.environ.get(EXAMPLES_ENV)
    if examples is not None:
        os.environ[EXAMPLES_ENV] = str(examples)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(EXAMPLES_ENV, None)
        else:
            os.environ[EXAMPLES_ENV] = previous


def kit_module(family: str, quantize: QuantSpec | None) -> str:
    """The one-class test module :func:`run_kit` runs."""
    spec = None if quantize is None else f"QuantSpec(**{quantize.model_dump()!r})"
    return MODULE.format(family=family, quantize=spec)


def run_kit(
    family: str, examples: int | None = None, quantize: QuantSpec | None = None
) -> KitReport:
    """Every conformance check against *family*'s synthetic install, quantized
    with *quantize* when given."""
    source = default_registry().get(family).source  # refuses an unknown family by name
    collector = _Collector()
    output = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="turbospark-conformance-") as scratch:
        root = Path(scratch)
        module = root / "test_conformance.py"
        module.write_text(kit_module(family, quantize))
        (root / "pytest.ini").write_text("[pytest]\n")
        args = [
            str(module),
            "-c", str(root / "pytest.ini"),
            "--rootdir", str(root),
            "-p", "turbospark",  # the kit's fixtures: a no-op when already auto-loaded
            "-p", "no:cacheprovider",
            "-q",
        ]  # fmt: skip
        with _examples(examples), contextlib.redirect_stdout(output):
            code = pytest.main(args, plugins=[collector])
    checks = list(collector.results.values())
    counts = {
        o: sum(c.outcome == o for c in checks) for o in ("passed", "failed", "skipped", "error")
    }
    ok = code == pytest.ExitCode.OK and bool(checks) and not (counts["failed"] or counts["error"])
    return KitReport(
        family=family,
        quantization=None if quantize is None else quantize.label(),
        source=source,
        passed=ok,
        counts=counts,
        checks=checks,
        pytest_output="" if ok else output.getvalue(),
    )
