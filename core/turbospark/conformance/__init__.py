"""The conformance kit for family plugins (public API).

Subclass :class:`FamilyConformance`, set ``family``, and run pytest: the
fixtures come from this package's pytest plugin, registered with pytest when
turbospark is installed. ``turbospark conformance FAMILY`` runs the same
checks from the command line. The kit runs on pytest and hypothesis, which
the core does not need: install ``turbospark[conformance]``.
"""

from importlib.util import find_spec

MISSING = [name for name in ("pytest", "hypothesis") if find_spec(name) is None]
if MISSING:
    raise ImportError(
        f"the conformance kit needs {' and '.join(MISSING)}: pip install 'turbospark[conformance]'"
    )

from turbospark.conformance.base import FamilyConformance  # noqa: E402
from turbospark.conformance.kit import FamilyKit  # noqa: E402

__all__ = ["FamilyConformance", "FamilyKit"]
