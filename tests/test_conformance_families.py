"""The conformance kit against every built-in family, exactly as a third party runs it.

The reference checkpoints are written by transformers' own classes
(``tests/fixtures/hf_reference/generate.py``); CI uses the committed files.
"""

from pathlib import Path
from typing import Any, ClassVar

from turbospark.conformance import FamilyConformance

HF_REFERENCE = Path(__file__).parent / "fixtures" / "hf_reference"


class TestGemma4(FamilyConformance):
    family = "gemma4"
    reference_checkpoints = tuple(
        HF_REFERENCE / name for name in ("gemma4_dense", "gemma4_moe", "gemma4_release")
    )


class TestQwenGdn(FamilyConformance):
    family = "qwen_gdn"
    synthetic_dims: ClassVar[dict[str, Any]] = {"mtp": True}  # DraftPolicies.mtp checked too
    reference_checkpoints = tuple(
        HF_REFERENCE / name for name in ("qwen3_5_text", "qwen3_5_release")
    )


class TestQwen4Exp(FamilyConformance):
    family = "qwen4_exp"
