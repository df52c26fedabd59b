"""From a directory to a model: plugin discovery, the install format, importing checkpoints, synthetic installs."""
