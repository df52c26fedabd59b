"""The conformance kit on quantized installs of every built-in family.

Each class builds its synthetic install quantized by the converter
``turbospark import --quantize`` runs (4-bit affine, groups of 32), so every
check the kit makes (pool, reuse, rewind, snapshots, batching, drafting,
steering, experts) runs on quantized modules. The whole kit per family is
slow-marked (about 20 s each on a CPU); the fast loop checks the wiring: the
kit's fixture and ``turbospark conformance --quantize`` hand the checks a
quantized model.
"""

from pathlib import Path
from typing import Any, ClassVar

import pytest

from turbospark.conformance import FamilyConformance, FamilyKit
from turbospark.conformance.run import kit_module
from turbospark.loading.install import build_synthetic_install
from turbospark.loading.quantization import QuantSpec, quantization_of, summary

FOUR_BIT = QuantSpec(bits=4, group_size=32)


@pytest.mark.slow
class TestGemma4FourBit(FamilyConformance):
    family = "gemma4"
    quantize = FOUR_BIT
    synthetic_dims: ClassVar[dict[str, Any]] = {"hidden_size_per_layer_input": 32}


@pytest.mark.slow
class TestGemma4MoeFourBit(FamilyConformance):
    family = "gemma4"
    quantize = FOUR_BIT
    synthetic_dims: ClassVar[dict[str, Any]] = {
        "num_experts": 4,
        "hidden_size_per_layer_input": 32,
    }


@pytest.mark.slow
class TestQwenGdnFourBit(FamilyConformance):
    family = "qwen_gdn"
    quantize = FOUR_BIT
    synthetic_dims: ClassVar[dict[str, Any]] = {"mtp": True}


@pytest.mark.slow
class TestQwen4ExpFourBit(FamilyConformance):
    family = "qwen4_exp"
    quantize = FOUR_BIT


def test_the_kit_checks_a_quantized_model(tmp_path: Path) -> None:
    build_synthetic_install("qwen4_exp", tmp_path, quantize=FOUR_BIT)
    kit = FamilyKit.create("qwen4_exp", tmp_path)
    assert summary(quantization_of(kit.model)) == "4-bit affine, group 32"


def test_the_command_line_kit_asks_for_the_settings_given() -> None:
    namespace: dict[str, Any] = {}
    exec(kit_module("qwen4_exp", FOUR_BIT), namespace)
    assert namespace["TestConformance"].quantize == FOUR_BIT
