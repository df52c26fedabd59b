"""Suite-wide settings: deterministic float32 on the CPU, and only our own plugins.

``TURBOSPARK_TEST_DEVICE=gpu`` runs the suite's arrays on MLX's GPU instead, with
float32 matmuls kept out of TF32, which is how the bench machine checks that the
decode step's GPU-only forms (:func:`turbospark.layers.fused.builds_for_gpu`)
still give the reference logits. CI never sets it.

A test marked ``bench`` (a benchmark's smoke test) is also ``slow``, so the inner
loop, ``-m "not slow"``, leaves it out and ``-m bench`` runs the benchmarks alone."""

import os
import tempfile

os.environ.setdefault("TURBOSPARK_PLUGINS", "gemma4,qwen_gdn,qwen4_exp")
# Every open remembers what it verified: the suite's records go to a folder of
# its own, never the user's cache.
os.environ.setdefault("TURBOSPARK_CACHE", tempfile.mkdtemp(prefix="turbospark-test-cache-"))
if os.environ.get("TURBOSPARK_TEST_DEVICE") == "gpu":
    os.environ.setdefault("MLX_ENABLE_TF32", "0")  # read when MLX loads

import mlx.core as mx
import pytest

if os.environ.get("TURBOSPARK_TEST_DEVICE") == "gpu":
    mx.set_default_device(mx.gpu)
else:
    mx.set_default_device(mx.cpu)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: "not slow" must see the mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("bench") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
