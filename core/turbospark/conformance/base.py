"""The aggregate base class a family author subclasses.

::

    from turbospark.conformance import FamilyConformance

    class TestMyFamily(FamilyConformance):
        family = "myfamily"
        synthetic_dims = {"num_layers": 2}   # optional

pytest then runs every check below against a synthetic install built by the
family's own ``turbospark_build_synthetic_install`` hook; the fixtures come
from :mod:`turbospark.conformance.pytest_plugin` (installed with turbospark as
a ``pytest11`` plugin). What runs follows from the family's declaration: pool
checks skip ("not swappable: ...") for a family that refuses a pool,
snapshot checks skip for a component that is not persistable, the expert
cache check skips for a family without MoE, and so on.
Checks are ``@final``: override the class attributes and fixtures, not them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from turbospark.conformance.batch_checks import BatchChecks
from turbospark.conformance.draft_checks import DraftChecks
from turbospark.conformance.expert_checks import ExpertCacheChecks
from turbospark.conformance.interleave_checks import InterleavingChecks
from turbospark.conformance.long_checks import LongContextChecks
from turbospark.conformance.pool_checks import PoolChecks
from turbospark.conformance.reference_checks import ReferenceChecks
from turbospark.conformance.state_checks import StateChecks
from turbospark.conformance.steering_checks import SteeringChecks
from turbospark.conformance.vision_checks import VisionChecks
from turbospark.loading.plugins import FamilyRegistry
from turbospark.loading.quantization import QuantSpec


# pytest collects base classes last-first: state checks run first, the property test last.
class FamilyConformance(
    DraftChecks,
    ExpertCacheChecks,
    SteeringChecks,
    BatchChecks,
    InterleavingChecks,
    LongContextChecks,
    VisionChecks,
    PoolChecks,
    StateChecks,
    ReferenceChecks,
):
    """Every check a family plugin must pass. Set :attr:`family`; tune the rest."""

    family: ClassVar[str]
    """The family name, as ``turbospark_family()`` declares it."""

    synthetic_dims: ClassVar[dict[str, Any]] = {}
    """Keyword arguments for ``build_synthetic_install`` (keep the model tiny)."""

    quantize: ClassVar[QuantSpec | None] = None
    """Quantize the synthetic install with these settings (``turbospark import
    --quantize``'s converter), so every check runs on a quantized model."""

    registry: ClassVar[FamilyRegistry | None] = None
    """Where the family is found; None means the installed plugins (entry points)."""

    atol: ClassVar[float] = 1e-4
    rtol: ClassVar[float] = 1e-4
    """Tolerance for logits compared across two paths (float32)."""

    reference_checkpoints: ClassVar[Sequence[Path]] = ()
    """Optional: checkpoint directories saved by the family's upstream, each with a
    ``reference.npz`` of its logits (see :mod:`turbospark.conformance.reference_checks`)."""

    reference_atol: ClassVar[float] = 1e-3
    """Tolerance for logits against the upstream's (float32; argmax must agree)."""

    max_examples: ClassVar[int] = 15
    """Hypothesis schedules per interleaving check
    (the environment variable ``TURBOSPARK_CONFORMANCE_EXAMPLES`` overrides it)."""
