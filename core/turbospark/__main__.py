"""``python -m turbospark`` runs the CLI."""

from turbospark.cli import run

run()
