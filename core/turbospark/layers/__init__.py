"""Layers shared by families: attention over the KV components, norms, RoPE variants."""
