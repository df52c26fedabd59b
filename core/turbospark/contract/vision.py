"""Vision inputs for one prompt: injected embeddings and multimodal rope positions.

The runner validates a map before installing it (a bad map changes nothing),
hands it to the family's forward, and taints the prefix record while it is
active: image placeholder ids are the same whatever picture filled them, so
token ids cannot prove that two prompts match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from pydantic import BaseModel, ConfigDict, Field

from turbospark.errors import VisionMapError


class MropePositions(BaseModel):
    """Per-position (t, h, w) rope triples for a prompt, as Qwen-VL processors emit them.

    ``rope_delta`` continues the temporal index past the prompt (for generated
    tokens); ``spans`` are ``(start, end)`` token ranges covered by images.
    """

    model_config = ConfigDict(frozen=True)

    triples: list[tuple[int, int, int]]
    rope_delta: int = 0
    spans: list[tuple[int, int]] = Field(default_factory=list)


@dataclass(frozen=True)
class VisionInjection:
    """Embeddings (``(n, hidden)``) that replace the token embeddings at ``start .. start+n``."""

    start: int
    embeddings: mx.array


@dataclass(frozen=True)
class VisionMap:
    injections: tuple[VisionInjection, ...]
    positions: MropePositions
    prompt_len: int
    _triples: mx.array = field(init=False, repr=False)

    @classmethod
    def validated(
        cls,
        injections: list[VisionInjection],
        positions: MropePositions,
        prompt_len: int,
        hidden_size: int,
    ) -> VisionMap:
        if prompt_len <= 0:
            raise VisionMapError(f"prompt_len must be positive, got {prompt_len}")
        if len(positions.triples) != prompt_len:
            raise VisionMapError(
                f"the vision map has {len(positions.triples)} rope triples for a "
                f"{prompt_len}-token prompt; pass exactly one (t, h, w) triple per prompt token"
            )
        for start, end in positions.spans:
            if not 0 <= start < end <= prompt_len:
                raise VisionMapError(
                    f"image span ({start}, {end}) lies outside the {prompt_len}-token prompt"
                )
        for inj in injections:
            if inj.embeddings.ndim != 2 or inj.embeddings.shape[1] != hidden_size:
                raise VisionMapError(
                    f"injected embeddings at {inj.start} have shape {tuple(inj.embeddings.shape)}; "
                    f"expected (n, {hidden_size}) for this model's hidden size"
                )
            if inj.start < 0 or inj.start + inj.embeddings.shape[0] > prompt_len:
                raise VisionMapError(
                    f"injected embeddings cover {inj.start}..{inj.start + inj.embeddings.shape[0]}, "
                    f"outside the {prompt_len}-token prompt"
                )
        vmap = cls(tuple(injections), positions, prompt_len)
        object.__setattr__(vmap, "_triples", mx.array(positions.triples, dtype=mx.int32))
        return vmap

    def rope_positions(self, start: int, length: int) -> mx.array:
        """``(3, length)`` int32 (t, h, w) positions for tokens ``start..``; past
        the prompt all three continue as ``index + rope_delta``."""
        inside = self._triples[start : min(start + length, self.prompt_len)]
        extra = max(0, start + length - max(start, self.prompt_len))
        if extra:
            first = max(start, self.prompt_len)
            tail = mx.arange(first, first + extra, dtype=mx.int32) + self.positions.rope_delta
            inside = mx.concatenate([inside, mx.stack([tail, tail, tail], axis=1)], axis=0)
        return inside.T

    def inject(self, embeddings: mx.array, start: int) -> mx.array:
        """Replace rows of ``(L, hidden)`` *embeddings* (tokens ``start..``) that images cover."""
        length = embeddings.shape[0]
        for inj in self.injections:
            lo, hi = max(start, inj.start), min(start + length, inj.start + inj.embeddings.shape[0])
            if lo < hi:
                rows = inj.embeddings[lo - inj.start : hi - inj.start].astype(embeddings.dtype)
                embeddings = mx.concatenate(
                    [embeddings[: lo - start], rows, embeddings[hi - start :]], axis=0
                )
        return embeddings
