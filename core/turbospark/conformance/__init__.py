"""The conformance kit for family plugins (public API).

Subclass :class:`FamilyConformance`, set ``family``, and run pytest: the
fixtures come from this package's pytest plugin, registered with pytest when
turbospark is installed. ``turbospark conformance FAMILY`` runs the same
checks from the command line.
"""

from turbospark.conformance.base import FamilyConformance
from turbospark.conformance.kit import FamilyKit

__all__ = ["FamilyConformance", "FamilyKit"]
