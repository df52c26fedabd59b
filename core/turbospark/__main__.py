"""``python -m turbospark`` runs the CLI."""

import sys

from turbospark.cli import main

sys.exit(main())
