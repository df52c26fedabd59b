"""Fixtures for runner-level tests: synthetic installs built once per session, and the
conformance mutants' kit (``mutant_kit``, from ``mutant_families``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mutant_families import mutant_kit  # noqa: F401  (the conformance mutants' fixture)

from turbospark import build_synthetic_install
from turbospark.text import TextCodec, load_text

VOCAB = 128


@pytest.fixture(scope="session")
def gemma4_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seed's install: 2 layers, 16 experts (top 4), sliding window 8."""
    path = tmp_path_factory.mktemp("gemma4")
    build_synthetic_install(
        "gemma4", path, vocab_size=VOCAB, num_layers=2, num_experts=16, top_k_experts=4,
        sliding_window=8, model_id="tiny-gemma4-session-pool", seed=0,
    )  # fmt: skip
    return path


@pytest.fixture(scope="session")
def qwen_gdn_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen_gdn")
    build_synthetic_install(
        "qwen_gdn", path, vocab_size=VOCAB, num_layers=4, model_id="tiny-bonsai-session-pool"
    )
    return path


@pytest.fixture(scope="session")
def qwen4_exp_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen4_exp")
    build_synthetic_install("qwen4_exp", path, vocab_size=VOCAB, model_id="qwen4-pool")
    return path


@pytest.fixture(scope="module")
def install(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny gemma4 install a server test module serves, under its ``MODEL`` name
    (modules with an install of their own define this fixture themselves)."""
    model = request.module.MODEL
    path = tmp_path_factory.mktemp(model)
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, sliding_window=8, model_id=model
    )
    return path


@pytest.fixture(scope="module")
def codec(install: Path) -> TextCodec:
    return load_text(install)


@pytest.fixture(scope="session")
def mtp_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen_gdn install with a multi-token-prediction head (its drafts' source)."""
    path = tmp_path_factory.mktemp("qwen_gdn_mtp")
    build_synthetic_install(
        "qwen_gdn", path, vocab_size=128, num_layers=4, model_id="tiny-qwen-mtp", mtp=True
    )
    return path
