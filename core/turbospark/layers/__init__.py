"""Layers shared by families: attention over the KV components, norms, RoPE variants,
the gated-DeltaNet mixer and the compiled elementwise chains (``fused``)."""
