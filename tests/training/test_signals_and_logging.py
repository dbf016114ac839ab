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


def _wandb_history(run_file: Path) -> list[dict]:
    """The ``history`` records of a wandb offline run file, read without wandb's reader: a
    LevelDB-style log (7-byte file header, 32 KiB blocks, records of a 7-byte header -- CRC,
    length, kind: 1 full, 2 first, 3 middle, 4 last -- and their bytes) of ``Record`` protobufs."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, block = run_file.read_bytes(), 7, 32768
    assert data[:4] == b":W&B"
    records, pending = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    history = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return history


def test_tensorboard_and_wandb_offline_hold_the_logged_losses(tmp_path):
    """Both sinks hold, per iteration, the loss and learning rate metrics.jsonl has; a run
    without the flags (negative control) writes neither."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = run_trainer([*TINY, "--tensorboard", "--train-iters", "3", "--wandb", "--wandb-project", "epas-test"], tmp_path / "run",
                      env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    rows = {r["iteration"]: r for r in run.metrics if "lm_loss" in r and "iteration" in r}
    assert sorted(rows) == [1, 2, 3]
    events = EventAccumulator(str(run.output_dir / "tensorboard"))
    events.Reload()
    for tag in ("lm_loss", "lr"):
        scalars = events.Scalars(f"train/{tag}")
        assert [e.step for e in scalars] == [1, 2, 3]
        assert [e.value for e in scalars] == pytest.approx([rows[i][tag] for i in (1, 2, 3)], rel=1e-6)  # float32 in TB
    offline = list((run.output_dir / "wandb").glob("offline-run-*/*.wandb"))
    assert len(offline) == 1
    history = [h for h in _wandb_history(offline[0]) if "train/lm_loss" in h]
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["train/lm_loss"] for h in history] == [rows[i]["lm_loss"] for i in (1, 2, 3)]
    assert [h["train/lr"] for h in history] == [rows[i]["lr"] for i in (1, 2, 3)]

    control = run_trainer([*TINY, "--no-tensorboard", "--train-iters", "1"], tmp_path / "control")
    assert not (control.output_dir / "tensorboard").exists() and not (control.output_dir / "wandb").exists()


@pytest.mark.distributed
def test_ranks_agree_on_the_signal_number_when_only_one_received_it(tmp_path):
    """Slurm's signal can reach rank 1 an iteration before rank 0: both stop together and both
    report the signal's number (not a placeholder on the rank that did not see it) -- with the
    blocking agreement and with the training loop's poll, which does not wait for a late rank:
    rank 0's poll returns before rank 1 has even posted its own (a marker file orders them)."""
    from epas_testing import json_lines, run_script

    proc = run_script(Path(__file__).parent / "scripts" / "exit_signal_agreement.py", [str(tmp_path)], nproc=2, timeout=300)
    rows = sorted(json_lines(proc.stdout, "AGREED"), key=lambda r: r["rank"])
    usr1 = int(signal.SIGUSR1)
    assert rows == [{"rank": r, "before": None, "after": usr1, "polls": [None, None, usr1], "drained": None,
                     "rank0_returned_first": [None, True][r]} for r in (0, 1)], proc.stdout
