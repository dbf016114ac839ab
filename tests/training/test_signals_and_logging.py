"""Exit signals save a checkpoint and exit 0; TensorBoard and wandb (offline) sinks are written."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epas_testing import REPO, TINY, parse_summary, read_metrics, run_trainer


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_exit_signal_saves_and_exits_zero(tmp_path, sig):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "epas_megatron.train", *TINY, "--train-iters", "5000", "--output-dir", str(out),
           "--epas-target-layers", "1", "--epas-interval", "3"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and len(read_metrics(out)) < 5:
        time.sleep(0.2)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    summary = parse_summary(stdout)
    assert summary["exit_reason"] == f"signal {int(sig)}"
    stopped = summary["iterations"]
    assert 5 <= stopped < 5000
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(stopped)
    meta = json.loads((out / "checkpoints" / f"iter_{stopped:07d}" / "run_meta.json").read_text())
    assert meta["sharing_layers"] == [3]


def test_tensorboard_and_wandb_offline(tmp_path):
    run = run_trainer([*TINY, "--tensorboard", "--train-iters", "3", "--wandb", "--wandb-project", "epas-test"], tmp_path / "run",
                      env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert list((run.output_dir / "tensorboard").glob("events.out.tfevents.*"))
    offline = list((run.output_dir / "wandb").glob("offline-run-*"))
    assert offline and list(offline[0].glob("*.wandb"))


@pytest.mark.distributed
def test_ranks_agree_on_the_signal_number_when_only_one_received_it():
    """Slurm's signal can reach rank 1 an iteration before rank 0: both stop together and both
    report the signal's number (not a placeholder on the rank that did not see it)."""
    from epas_testing import json_lines, run_script

    proc = run_script(Path(__file__).parent / "scripts" / "exit_signal_agreement.py", nproc=2, timeout=300)
    rows = sorted(json_lines(proc.stdout, "AGREED"), key=lambda r: r["rank"])
    assert rows == [{"rank": r, "before": None, "after": int(signal.SIGUSR1)} for r in (0, 1)], proc.stdout
