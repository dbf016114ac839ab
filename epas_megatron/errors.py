"""Exceptions that reach the user as a message and an exit status, not a traceback."""


class ConfigError(ValueError):
    """A bad flag, config value or input path; raised before any process group or data work.

    The message names the knob to change (``--tp``, ``--data``, ...). Entry points print it and
    exit with status 2.
    """

    exit_code = 2


class NonFiniteError(RuntimeError):
    """A training step produced a non-finite loss or gradient norm (bf16 and fp32; an fp16 step
    whose scaled gradients overflow is skipped by the loss scaler instead, as Megatron does).

    The run stops where it is: nothing of the bad step is saved, saves already in flight (of
    earlier, good iterations) complete, and ``--load`` of the run's checkpoint directory resumes
    from the last good one. Entry points print it as an ``error:`` line and exit with status 3.
    """

    exit_code = 3
