"""Has the run in OUTPUT_DIR reached its --train-iters? (used by slurm/pretrain.sbatch to requeue)

    python launch/run_progress.py OUTPUT_DIR      # prints one JSON line

Reads only files the trainer writes: ``config.yaml`` (the resolved run: ``train_iters`` and the
checkpoint directory), the checkpoint pointer ``latest_checkpointed_iteration.txt`` and
``metrics.jsonl`` (the last training iteration it reached, which also covers runs with
``--no-save-final``). Needs PyYAML only (no torch), so it costs nothing in a batch script.

Exit status: 0 finished, 3 not finished (resume it), 2 no run there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

FINISHED, UNFINISHED, NO_RUN = 0, 3, 2
POINTER = "latest_checkpointed_iteration.txt"


def last_logged_iteration(metrics: Path) -> int:
    """Highest ``iteration`` of a training record (records without ``kind``) in metrics.jsonl."""
    best = 0
    if not metrics.is_file():
        return best
    with open(metrics) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if isinstance(record, dict) and "kind" not in record and isinstance(record.get("iteration"), int):
                best = max(best, record["iteration"])
    return best


def progress(output_dir: str | Path) -> dict:
    """{'train_iters', 'checkpoint_iteration', 'logged_iteration', 'finished'}; raises
    FileNotFoundError when there is no config.yaml."""
    out = Path(output_dir)
    config = yaml.safe_load((out / "config.yaml").read_text())
    train_iters = int(config["training"]["train_iters"])
    ckpt_root = Path(config.get("checkpoint", {}).get("save") or out / "checkpoints")
    pointer = ckpt_root / POINTER
    text = pointer.read_text().strip() if pointer.is_file() else ""
    checkpoint_iteration = int(text) if text.isdigit() else None
    logged = last_logged_iteration(out / "metrics.jsonl")
    reached = max(checkpoint_iteration or 0, logged)
    return {
        "output_dir": str(out),
        "train_iters": train_iters,
        "checkpoint_iteration": checkpoint_iteration,
        "logged_iteration": logged,
        "finished": reached >= train_iters,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: run_progress.py OUTPUT_DIR", file=sys.stderr)
        return NO_RUN
    try:
        state = progress(argv[0])
    except (FileNotFoundError, KeyError, TypeError, ValueError, yaml.YAMLError) as e:
        print(f"error: {argv[0]} holds no readable run ({type(e).__name__}: {e})", file=sys.stderr)
        return NO_RUN
    print("progress " + json.dumps(state), flush=True)
    return FINISHED if state["finished"] else UNFINISHED


if __name__ == "__main__":
    sys.exit(main())
