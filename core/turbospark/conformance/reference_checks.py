"""Reference logits: the family against its upstream, on checkpoints the upstream wrote.

Optional. A family that ships reference fixtures (a checkpoint directory as its
upstream saved it, plus ``reference.npz`` holding ``input_ids`` ``(T,)`` and
the upstream's float32 ``logits`` ``(T, vocab)`` at every position) lists their
directories in ``reference_checkpoints``. Each is imported *as saved* through
``turbospark import`` (so the config reading is on trial too, not just the
math) and its logits are compared on four paths: one token at a time,
prefill then decode, the whole sequence in one forward, and split into uneven
chunks. The built-in families' fixtures are written by transformers' own
classes (``tests/fixtures/hf_reference/generate.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, final

import mlx.core as mx
import numpy as np
import pytest

from turbospark.conformance.diagnose import fail
from turbospark.conformance.kit import FamilyKit
from turbospark.loading.importer import import_checkpoint
from turbospark.loading.plugins import FamilyRegistry

REFERENCE = "reference.npz"


def _sequential(kit: FamilyKit, ids: list[int]) -> np.ndarray:
    """Through the runner, one token at a time."""
    runner = kit.open(1)
    return np.stack([np.asarray(runner.produce(t, i)) for i, t in enumerate(ids)])


def _prefill_then_decode(kit: FamilyKit, ids: list[int]) -> np.ndarray:
    """Through the runner: half the ids in one prefill, then one token at a time.
    Rows before the prefill's last are not produced, so they are copied as NaN."""
    runner = kit.open(1)
    half = len(ids) // 2
    rows = [np.full(kit.arch.vocab_size, np.nan, np.float32)] * (half - 1)
    rows.append(np.asarray(runner.prefill_chunk(ids[:half], 0)))
    rows += [np.asarray(runner.produce(t, half + i)) for i, t in enumerate(ids[half:])]
    return np.stack(rows)


def _chunks(kit: FamilyKit, ids: list[int], sizes: list[int]) -> np.ndarray:
    """Through the family's forward hook, every row of every chunk."""
    state, out, start = kit.new_state(), [], 0
    for size in sizes:
        chunk = ids[start : start + size]
        out.append(np.asarray(kit.forward(state, chunk, start, "all")))
        start += len(chunk)
    return np.concatenate(out)


def _chunked(kit: FamilyKit, ids: list[int]) -> np.ndarray:
    return _chunks(kit, ids, [len(ids)])


def _split(kit: FamilyKit, ids: list[int]) -> np.ndarray:
    return _chunks(kit, ids, [5, 1, 7, len(ids)])


PATHS: dict[str, Callable[[FamilyKit, list[int]], np.ndarray]] = {
    "sequential": _sequential,
    "prefill_then_decode": _prefill_then_decode,
    "chunked": _chunked,
    "split": _split,
}


def reference_gaps(
    checkpoint: Path, out: Path, family: str, registry: FamilyRegistry
) -> dict[str, tuple[float, bool]]:
    """Import *checkpoint* into *out* and return, per path, the largest absolute
    logit difference from its reference and whether every argmax agrees."""
    import_checkpoint(checkpoint, out, registry=registry, progress=False)
    reference = np.load(checkpoint / REFERENCE)
    ids = [int(t) for t in reference["input_ids"]]
    expected = reference["logits"].astype(np.float32)
    kit = FamilyKit.create(family, out, registry, context_length=max(64, len(ids)))
    gaps: dict[str, tuple[float, bool]] = {}
    for name, run in PATHS.items():
        actual = run(kit, ids)
        rows = ~np.isnan(actual[:, 0])
        a, e = actual[rows], expected[rows]
        same = bool(np.array_equal(a.argmax(-1), e.argmax(-1)))
        gaps[name] = (float(np.max(np.abs(a - e))), same)
        mx.clear_cache()
    return gaps


class ReferenceChecks:
    """Logits against the upstream's, for each of ``reference_checkpoints``."""

    family: ClassVar[str]
    reference_atol: ClassVar[float]  # both set on FamilyConformance

    @final
    def test_matches_reference_logits(
        self,
        reference_checkpoint: Path | None,
        family_registry: FamilyRegistry,
        tmp_path: Path,
    ) -> None:
        """Imported as saved, the checkpoint computes its upstream's logits on
        every path, within ``reference_atol`` and with the same argmax."""
        if reference_checkpoint is None:
            pytest.skip("no reference_checkpoints: the family ships no upstream fixtures")
        atol = self.reference_atol
        gaps = reference_gaps(
            reference_checkpoint, tmp_path / "install", self.family, family_registry
        )
        bad = {k: v for k, v in gaps.items() if v[0] > atol or not v[1]}
        if bad:
            fail(
                f"{reference_checkpoint.name}: logits differ from the reference "
                + ", ".join(
                    f"{k}: max {g:.2e}{'' if same else ', argmax differs'}"
                    for k, (g, same) in bad.items()
                )
                + f" (tolerance {atol})"
            )
