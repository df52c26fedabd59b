"""CUDA kernels for MLX's CUDA backend, each behind the portable layer that picks it."""
