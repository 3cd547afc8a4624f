"""Errors a user can act on: the CLI prints them without a traceback."""


class UserError(Exception):
    """An error caused by the user's input (a path, a flag, a dataset, a config value)."""
