"""Suite-wide settings: deterministic float32 on the CPU, and only our own plugins."""

import os

os.environ.setdefault("TURBOSPARK_PLUGINS", "gemma4,qwen_gdn,qwen4_exp")

import mlx.core as mx

mx.set_default_device(mx.cpu)
