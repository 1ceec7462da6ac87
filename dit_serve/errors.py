"""Errors shared by the command line's local, client and server commands (no heavy imports)."""


class UsageError(ValueError):
    """Bad user input: the CLI prints the message on one line and exits 2."""


class ConfigError(ValueError):
    """An unreadable or invalid config file; the message names the file and the field."""
