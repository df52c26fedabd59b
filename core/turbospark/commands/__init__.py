"""CLI subcommands, one module each (see turbospark.cli)."""

from __future__ import annotations

from pathlib import Path

from turbospark.install import read_manifest
from turbospark.text import TextCodec, load_text


def install_text(path: str | Path) -> TextCodec:
    """The install's tokenizer, after checking *path* is an install at all (so a
    wrong directory is named as such, not as a missing tokenizer)."""
    read_manifest(path)
    return load_text(path)
