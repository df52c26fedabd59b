"""Every error turbospark raises on bad input, one class per kind of mistake.

Messages say what was wrong *and* what to do about it; the classes let callers
(the server, the CLI) map a refusal to the right status without parsing text.
"""


class TurbosparkError(Exception):
    """Base class: bad input or an impossible request, refused before any state changed."""


class InstallError(TurbosparkError):
    """An install directory is missing a file, or a file does not match its manifest."""


class PluginError(TurbosparkError):
    """A family plugin is missing, broken, or ambiguous."""


class FamilyNotFound(PluginError):
    """No installed plugin claims the requested family or Hugging Face model type."""


class SessionPoolUnsupported(TurbosparkError):
    """`session_slots > 1` asked of a family whose state cannot be parked."""


class InvalidInput(TurbosparkError):
    """A token, position or length the runner cannot accept (nothing was fed)."""


class ContextOverflow(InvalidInput):
    """The write would run past the runner's context length."""


class VisionMapError(InvalidInput):
    """A vision map that does not fit the prompt it claims to describe."""


class RewindError(TurbosparkError):
    """A write at an earlier position that a state component cannot rewind to."""
