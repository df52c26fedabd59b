"""``bench/step_spikes.py`` at its tiniest: a decode across three growths of
the buffers on the kernels' path (their contract in ops) traces no layer
step after the runner's load, and the report holds what it promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import kind_install
from turbospark.layers import attention_step
from turbospark.layers.cuda import attention as attention_cuda

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.bench


def test_step_spikes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import step_spikes

    # What the benchmark replaces for its process, put back after this test.
    for module, name in (
        (attention_cuda, "available"), (attention_cuda, "decode"),
        (attention_cuda, "decode_step"), (attention_step, "owner_layer"),
        (attention_step, "shared_layer"),
    ):  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name))
    install = kind_install(tmp_path / "gemma4", "gemma4", {"num_layers": 4, "sliding_window": 8})
    try:
        step_spikes.take_kernel_path()
        result = step_spikes.ours(install, [3 + i % 90 for i in range(200)], 600)
    finally:
        attention_step.owner_trace.cache_clear()
        attention_step.shared_trace.cache_clear()
    assert result["traces_at_open"] > 0
    assert result["traces_in_prompt"] == result["traces_in_decode"] == 0
    assert result["median_ms"] > 0 and result["first_ms"] > 0
    assert all(step["traces"] == 0 for step in result["slow_steps"])
