"""Subcommands of the `memalpha` console script, one module each."""
