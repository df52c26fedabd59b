"""The conformance kit against every built-in family, exactly as a third party runs it."""

from turbospark.conformance import FamilyConformance


class TestGemma4(FamilyConformance):
    family = "gemma4"


class TestQwenGdn(FamilyConformance):
    family = "qwen_gdn"


class TestQwen4Exp(FamilyConformance):
    family = "qwen4_exp"
