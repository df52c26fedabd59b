"""Prompt in, tokens out: the runner, the engine's decode loop, sampling, logits processors and speculation."""
