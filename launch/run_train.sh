#!/usr/bin/env bash
# Launch epas-megatron training with torchrun: single node, or one launcher per node under srun.
#
#   CONFIG=launch/configs/tiny.yaml launch/run_train.sh --train-iters 50 --output-dir runs/tiny
#   NPROC_PER_NODE=2 CONFIG=tiny launch/run_train.sh --tp 2
#   srun --ntasks-per-node=1 launch/run_train.sh ...        (inside an sbatch script)
#
# Arguments go to the trainer (python -m epas_megatron.train --help lists them). Environment
# knobs (CONFIG, NPROC_PER_NODE, RDZV_*, DRY_RUN, ...) are documented in launch/launch.py.
# PYTHON picks the interpreter (default: the repository's .venv, else python3).
set -euo pipefail
# Slurm signals every process of a job step: do not die of SIGUSR1 before python takes over.
trap '' USR1
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$HERE/../.venv/bin/python" ]]; then PYTHON="$HERE/../.venv/bin/python"; else PYTHON=python3; fi
fi
exec "$PYTHON" "$HERE/launch.py" "$@"
