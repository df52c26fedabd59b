"""pytest fixtures for :class:`~turbospark.conformance.FamilyConformance`.

Registered with pytest through turbospark's ``pytest11`` entry point, so a
family's test module needs no conftest. Fixtures (override any of them in
your own conftest or test class, keeping the shape documented here):

``family_registry``  a :class:`~turbospark.loading.plugins.FamilyRegistry` that holds the
                     class's ``family``. Default: the class's ``registry``
                     attribute, else the installed plugins.
``family_install``   a :class:`~pathlib.Path` to an install directory of that
                     family (``manifest.json``, ``config.json``, safetensors).
                     Default: a synthetic install built once per class by the
                     family's own hook with the class's ``synthetic_dims``,
                     quantized with the class's ``quantize`` when set.
``kit``              the :class:`~turbospark.conformance.FamilyKit` every check
                     takes, built from the two above and the class's tolerances.
``component``        not a fixture: checks that take it are parametrized with
                     every component name the family declares.
``reference_checkpoint``  not a fixture: the reference check is parametrized with
                     the class's ``reference_checkpoints`` (None, a skip, when empty).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from turbospark.conformance.base import FamilyConformance
from turbospark.conformance.kit import FamilyKit, examples_from_env
from turbospark.loading.install import build_synthetic_install
from turbospark.loading.plugins import FamilyRegistry, default_registry


def conformance_class(cls: type | None) -> type[FamilyConformance]:
    if cls is None or not issubclass(cls, FamilyConformance):
        raise pytest.UsageError(
            "turbospark's conformance fixtures serve FamilyConformance subclasses only"
        )
    if not isinstance(getattr(cls, "family", None), str):
        raise pytest.UsageError(
            f'{cls.__name__} subclasses FamilyConformance but sets no `family = "<name>"`'
        )
    return cls


@pytest.fixture(scope="class")
def family_registry(request: pytest.FixtureRequest) -> FamilyRegistry:
    return conformance_class(request.cls).registry or default_registry()


@pytest.fixture(scope="class")
def family_install(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    family_registry: FamilyRegistry,
) -> Path:
    cls = conformance_class(request.cls)
    path = tmp_path_factory.mktemp(f"{cls.family}-install")
    build_synthetic_install(
        cls.family, path, registry=family_registry, quantize=cls.quantize, **cls.synthetic_dims
    )
    return path


@pytest.fixture(scope="class")
def kit(
    request: pytest.FixtureRequest, family_registry: FamilyRegistry, family_install: Path
) -> FamilyKit:
    cls = conformance_class(request.cls)
    return FamilyKit.create(
        cls.family,
        family_install,
        family_registry,
        atol=cls.atol,
        rtol=cls.rtol,
        examples=examples_from_env(cls.max_examples),
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per declared component for checks that take ``component``, one per
    reference checkpoint for the check that takes ``reference_checkpoint``."""
    cls = metafunc.cls
    if cls is None or not issubclass(cls, FamilyConformance):
        return
    cls = conformance_class(cls)
    if "reference_checkpoint" in metafunc.fixturenames:
        paths = [Path(p) for p in cls.reference_checkpoints]
        metafunc.parametrize(
            "reference_checkpoint", paths or [None], ids=[p.name for p in paths] or ["none"]
        )
    if "component" in metafunc.fixturenames:
        spec = (cls.registry or default_registry()).get(cls.family).spec
        metafunc.parametrize("component", [c.name for c in spec.components])
