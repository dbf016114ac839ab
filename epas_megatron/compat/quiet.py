"""Silence known, harmless library noise on the console (entry points call this first).

Only exact, understood messages are filtered: Megatron-Core's notices that Transformer Engine /
apex are absent (expected on CPU), experimental/deprecation notices of APIs we do not use,
PyTorch's "no CUDA runtime" notice, and DCP's single-process notices when a checkpoint is read
without a process group. Everything else still prints.
"""

from __future__ import annotations

import logging
import warnings

_MESSAGES = (
    r"Transformer Engine and Apex are not installed.*",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"MimoModelConfig is experimental.*",
    r"full scope is deprecated.*",
    r"torch\.distributed is disabled, unavailable or uninitialized.*",
    r"The argument order of load has been changed.*",
)


class _DropMessages(logging.Filter):
    def __init__(self, fragments):
        super().__init__()
        self.fragments = fragments

    def filter(self, record):
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def quiet_library_noise() -> None:
    """Install the warning and logging filters (idempotent)."""
    for message in _MESSAGES:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("torch.utils.cpp_extension").addFilter(_DropMessages(("No CUDA runtime is found",)))
    logging.getLogger("megatron.core.dist_checkpointing").addFilter(_DropMessages(("async save is deprecated",)))
    logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").addFilter(_DropMessages(("async save is deprecated",)))
