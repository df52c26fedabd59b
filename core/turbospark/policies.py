"""Runner policies: expert cache slots, speculative drafting and activation steering.

These mirror the original runtime's knobs. Each is a small validated value;
the ``off()`` / ``fixed()`` constructors are the names callers use. Steering
lives in :mod:`turbospark.steering` (its math and file format) and is
re-exported here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from turbospark.errors import InvalidInput
from turbospark.steering import SteeringPolicy

__all__ = ["DraftPolicies", "ExpertCacheSlots", "SteeringPolicy"]


class ExpertCacheSlots(BaseModel):
    """How many MoE experts per layer stay resident. All experts are resident
    with MLX's unified memory today; the bound is validated against the arch."""

    model_config = ConfigDict(frozen=True)

    slots: int = Field(gt=0)

    @classmethod
    def fixed(cls, slots: int) -> ExpertCacheSlots:
        if slots <= 0:
            raise InvalidInput(
                f"ExpertCacheSlots.fixed({slots}): at least one expert slot is needed; "
                "use the model's top_k_experts or more"
            )
        return cls(slots=slots)


class DraftPolicies(BaseModel):
    """Speculative decoding. Only ``off`` is implemented; drafts need snapshot rollback."""

    model_config = ConfigDict(frozen=True)

    mode: Literal["off"] = "off"

    @classmethod
    def off(cls) -> DraftPolicies:
        return cls()
