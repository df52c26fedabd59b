"""Suite-wide settings: deterministic float32 on the CPU, and only our own plugins.

``TURBOSPARK_TEST_DEVICE=gpu`` runs the suite's arrays on MLX's GPU instead, with
float32 matmuls kept out of TF32, which is how the bench machine checks that the
decode step's GPU-only forms (:func:`turbospark.layers.fused.builds_for_gpu`)
still give the reference logits. CI never sets it."""

import os

os.environ.setdefault("TURBOSPARK_PLUGINS", "gemma4,qwen_gdn,qwen4_exp")
if os.environ.get("TURBOSPARK_TEST_DEVICE") == "gpu":
    os.environ.setdefault("MLX_ENABLE_TF32", "0")  # read when MLX loads

import mlx.core as mx

if os.environ.get("TURBOSPARK_TEST_DEVICE") == "gpu":
    mx.set_default_device(mx.gpu)
else:
    mx.set_default_device(mx.cpu)
