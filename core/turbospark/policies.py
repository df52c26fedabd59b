"""Runner policies: expert cache slots, speculative drafting and activation steering.

These mirror the original runtime's knobs. Each is a small validated value;
the ``off()`` / ``fixed()`` constructors are the names callers use.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from turbospark.errors import InvalidInput


class ExpertCacheSlots(BaseModel):
    """How many routed experts per MoE layer stay resident; the others are read
    from the install's safetensors into a slot when a token routes to them
    (:mod:`turbospark.expert_cache`). Output is the same whatever the count.

    - ``fixed(n)``: *n* slots per layer; at least the model's ``top_k_experts``
      (checked at ``Runner.open``), and more than ``num_experts`` means all.
    - ``auto()``: *n* from the memory available when the runner opens: half of
      it (MLX's recommended working set on a GPU, free physical memory on the
      CPU), less the weights that are not experts, spread evenly over the MoE
      layers and divided by one expert's bytes; clamped to ``top_k_experts ..
      num_experts`` (:func:`turbospark.expert_cache.auto_slots`).
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


class DraftPolicies(BaseModel):
    """Speculative decoding. Only ``off`` is implemented; drafts need snapshot rollback."""

    model_config = ConfigDict(frozen=True)

    mode: Literal["off"] = "off"

    @classmethod
    def off(cls) -> DraftPolicies:
        return cls()


class SteeringPolicy(BaseModel):
    """Activation steering hooks. Only ``off`` is implemented."""

    model_config = ConfigDict(frozen=True)

    mode: Literal["off"] = "off"

    @classmethod
    def off(cls) -> SteeringPolicy:
        return cls()
