"""``epas-train`` / ``python -m epas_megatron.train``: pretrain a LLaMA model with EPAS.

Run one process, or launch with torchrun (``launch/run_train.sh`` picks the arguments)::

    epas-train --preset small --output-dir runs/small
    torchrun --nproc-per-node 2 -m epas_megatron.train --preset tiny --tp 2

Exit status: 0 on success (also after a checkpoint on SIGTERM/SIGUSR1), 2 on bad input or
configuration (reported before any process group or data work), 3 when a step's loss or
gradient norm is not finite (nothing of that state is saved; see engine/step.py), 1 on other failures.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from epas_megatron.errors import ConfigError, NonFiniteError


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, validate, train; returns the exit status."""
    from epas_megatron.compat.quiet import quiet_library_noise
    from epas_megatron.training.exit_signal import ExitSignal

    # Installed first: a SIGTERM/SIGUSR1 that arrives during setup is honoured after the first
    # iteration (checkpoint, exit 0) instead of killing the process or being lost.
    exit_signal = ExitSignal()
    exit_signal.install()
    quiet_library_noise()
    from epas_megatron.config.cli import parse_config
    from epas_megatron.runtime.accelerator import check_accelerator
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    try:
        check_accelerator()  # before anything decides between CPU and GPU
        run = resolve_run(parse_config(argv))
        trainer = Trainer(run, exit_signal=exit_signal)  # checks a resumed checkpoint's schedules
    except ConfigError as error:
        exit_signal.restore()
        print(f"error: {error}", file=sys.stderr, flush=True)
        return ConfigError.exit_code

    try:
        trainer.setup()
        trainer.train()
    except (ConfigError, NonFiniteError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
