"""The whole conformance kit for tinyllama: one class, no conftest.

The fixtures come from turbospark's pytest plugin (a ``pytest11`` entry point
installed with turbospark); the checks that run follow from what
``turbospark_family()`` declares.
"""

from typing import Any, ClassVar

from turbospark.conformance import FamilyConformance


class TestTinyLlama(FamilyConformance):
    family = "tinyllama"
    synthetic_dims: ClassVar[dict[str, Any]] = {"num_layers": 2, "vocab_size": 96}
