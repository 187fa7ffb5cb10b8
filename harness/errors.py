"""Errors the CLI turns into one clear line and exit code 2."""


class UserError(Exception):
    """Bad input or a broken environment: the user can fix it, no traceback needed."""

    exit_code = 2


class ConfigError(UserError):
    """A config file, field or value is wrong; the message names it."""
