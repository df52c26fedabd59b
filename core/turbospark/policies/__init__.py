"""Runner policies: expert cache slots, speculative drafting and activation steering.

These mirror the original runtime's knobs. Each is a small validated value;
the ``off()`` / ``fixed()`` constructors are the names callers use. Steering
lives in :mod:`turbospark.policies.steering` (its math and file format) and is
re-exported here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from turbospark.errors import InvalidInput
from turbospark.policies.steering import SteeringPolicy

__all__ = ["DraftPolicies", "ExpertCacheSlots", "SteeringPolicy"]


class ExpertCacheSlots(BaseModel):
    """How many routed experts per MoE layer stay resident; the others are read
    from the install's safetensors into a slot when a token routes to them
    (:mod:`turbospark.policies.expert_cache`). Output is the same whatever the count.

    - ``fixed(n)``: *n* slots per layer; at least the model's ``top_k_experts``
      (checked at ``Runner.open``), and more than ``num_experts`` means all.
    - ``auto()``: *n* from the memory available when the runner opens: half of
      it (MLX's recommended working set on a GPU, free physical memory on the
      CPU), less the weights that are not experts, spread evenly over the MoE
      layers and divided by one expert's bytes; clamped to ``top_k_experts ..
      num_experts`` (:func:`turbospark.policies.expert_cache.auto_slots`).
    - ``all()``: every expert resident, loaded with the other weights (no
      streaming, no cost per step). The only policy a family without MoE takes.
    """

    model_config = ConfigDict(frozen=True)

    mode: Literal["fixed", "auto", "all"] = "all"
    slots: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _slots_only_when_fixed(self) -> ExpertCacheSlots:
        if (self.mode == "fixed") != (self.slots is not None):
            raise ValueError("slots is set for mode 'fixed' and only for it")
        return self

    @classmethod
    def fixed(cls, slots: int) -> ExpertCacheSlots:
        if slots <= 0:
            raise InvalidInput(
                f"ExpertCacheSlots.fixed({slots}): at least one expert slot is needed; "
                "use the model's top_k_experts or more"
            )
        return cls(mode="fixed", slots=slots)

    @classmethod
    def auto(cls) -> ExpertCacheSlots:
        return cls(mode="auto")

    @classmethod
    def all(cls) -> ExpertCacheSlots:
        return cls(mode="all")

    @classmethod
    def parse(cls, text: str) -> ExpertCacheSlots:
        """``N``, ``auto`` or ``all``, as ``--expert-cache-slots`` takes it."""
        word = text.strip().lower()
        if word in ("auto", "all"):
            return cls(mode=word)
        try:
            return cls.fixed(int(word))
        except ValueError:
            raise InvalidInput(
                f"--expert-cache-slots {text!r}: use a number of experts per layer, auto or all"
            ) from None

    def __str__(self) -> str:
        return str(self.slots) if self.mode == "fixed" else self.mode


DraftMode = Literal["off", "ngram", "mtp"]


class DraftPolicies(BaseModel):
    """Speculative decoding: how drafts are proposed (``turbospark.generation.speculation``
    verifies them in one forward and rolls rejected ones back).

    - ``off()`` (the default): one token per forward.
    - ``ngram(max_draft, min_match)``: prompt lookup. The last ``min_match`` or
      more tokens are looked up earlier in the prompt and reply, and what
      followed the most recent match is proposed, up to ``max_draft`` tokens.
    - ``mtp(depth)``: the checkpoint's multi-token-prediction head proposes
      ``depth`` tokens (qwen_gdn installs that carry ``mtp.*`` weights).

    ``max_draft`` is the deepest a round may draft; the adaptive depth backs
    off below it when drafts are rejected.
    """

    model_config = ConfigDict(frozen=True)

    mode: DraftMode = "off"
    max_draft: int = Field(default=0, ge=0)
    min_match: int = Field(default=0, ge=0)

    @classmethod
    def off(cls) -> DraftPolicies:
        return cls()

    @classmethod
    def ngram(cls, max_draft: int = 4, min_match: int = 2) -> DraftPolicies:
        if max_draft <= 0:
            raise InvalidInput(
                f"DraftPolicies.ngram(max_draft={max_draft}): a draft needs a depth of 1 or more; "
                "use 4 (or DraftPolicies.off() for no drafts)"
            )
        if min_match <= 0:
            raise InvalidInput(
                f"DraftPolicies.ngram(min_match={min_match}): a lookup needs at least one token "
                "to match; use 2"
            )
        return cls(mode="ngram", max_draft=max_draft, min_match=min_match)

    @classmethod
    def mtp(cls, depth: int = 2) -> DraftPolicies:
        if depth <= 0:
            raise InvalidInput(
                f"DraftPolicies.mtp(depth={depth}): a draft needs a depth of 1 or more; "
                "use 2 (or DraftPolicies.off() for no drafts)"
            )
        return cls(mode="mtp", max_draft=depth)

    @classmethod
    def named(cls, mode: str) -> DraftPolicies:
        """The CLI's ``--draft ngram|mtp|off`` with each policy's default depth."""
        makers = {"off": cls.off, "ngram": cls.ngram, "mtp": cls.mtp}
        if mode not in makers:
            raise InvalidInput(f"unknown draft policy {mode!r}; use one of ngram, mtp, off")
        return makers[mode]()

    @model_validator(mode="after")
    def _depth(self) -> DraftPolicies:
        # Built directly (a server setting, JSON) the same refusals apply.
        if self.mode != "off" and self.max_draft <= 0:
            raise InvalidInput(
                f"DraftPolicies(mode={self.mode!r}) has a draft depth of {self.max_draft}; "
                "a draft needs a depth of 1 or more"
            )
        if self.mode == "ngram" and self.min_match <= 0:
            raise InvalidInput(
                f"DraftPolicies(mode='ngram') has min_match={self.min_match}; use 1 or more"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.mode != "off"
