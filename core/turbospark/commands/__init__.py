"""CLI subcommands, one module each (see turbospark.cli)."""
