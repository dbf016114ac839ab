"""Exceptions that reach the user as a message and an exit status, not a traceback."""


class ConfigError(ValueError):
    """A bad flag, config value or input path; raised before any process group or data work.

    The message names the knob to change (``--tp``, ``--data``, ...). Entry points print it and
    exit with status 2.
    """

    exit_code = 2
