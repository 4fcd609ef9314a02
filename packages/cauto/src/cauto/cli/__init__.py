"""cauto.cli: the `cauto` command (see cauto.cli.main)."""
