"""Errors shared by the command line's local and client commands (no heavy imports)."""


class UsageError(ValueError):
    """Bad user input: the CLI prints the message on one line and exits 2."""
