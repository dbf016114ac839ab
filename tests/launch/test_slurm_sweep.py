"""slurm/sweep.sh on the real two-node cluster: 3 points -> 3 jobs -> one CSV, a table, plots.

Each row is checked against the point's own outputs (metrics.jsonl of its run, the versions
installed here, the repository's HEAD), and the report's ratios against ratios computed here.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.distributed, pytest.mark.cpu_only]  # the CPU cluster of test_slurm_pretrain

REPO = Path(__file__).resolve().parents[2]
REGIONS = {"0": 0, "1": 1, "0.5": 2}  # region as given -> sharing layers of the 4-layer tiny model
ITERS, WARMUP = 12, 3


def independent_tokens_per_s(metrics_path: Path, warmup: int) -> tuple[float, list[dict]]:
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    timed = [r for r in records if "kind" not in r and r["iteration"] > warmup]
    seq, gbs = 64, 2  # tiny: seq 64, micro-batch 2 x DP 1
    seconds = sum(r["iteration_time_s"] for r in timed)
    return len(timed) * seq * gbs / seconds, records


def test_sweep_three_points(cluster, tmp_path):
    sweep_dir = tmp_path / "sweep"
    env = {
        **os.environ,
        "SLURM_CONF": str(cluster.conf),
        "PYTHON": sys.executable,
        "PRESETS": "tiny",
        "REGIONS": " ".join(REGIONS),
        "TPS": "1",
        "PPS": "1",
        "MBS": "2",
        "SWEEP_ITERS": str(ITERS),
        "SWEEP_WARMUP": str(WARMUP),
        "SWEEP_DIR": str(sweep_dir),
        "SBATCH_ARGS": "--gpus-per-node=0 --time=10",
        "SWEEP_WAIT": "1",
        "SWEEP_POLL": "1",
        "OMP_NUM_THREADS": "1",
        # sweep.sh checked every point's flags with the trainer's own checks (region-table) before
        # submitting; the launchers' repeat of that check (Megatron-Core imported on each point's
        # node) is left out here. A launch with it runs in test_slurm_pretrain.py (the USR1 job).
        "LAUNCH_VALIDATE": "0",
    }
    env.pop("CONFIG", None)
    proc = subprocess.run(["bash", str(REPO / "slurm" / "sweep.sh")], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = re.findall(r"^submitted (\d+) preset=tiny region=(\S+) tp=1 pp=1 mbs=2$", proc.stdout, re.M)
    assert sorted(region for _, region in jobs) == sorted(REGIONS)

    # The CSV: one header, one row per job, all ok, every column from the point's own outputs.
    csv_path = sweep_dir / "sweep.csv"
    lines = csv_path.read_text().splitlines()
    assert sum(1 for line in lines if line.startswith("job_id,")) == 1
    rows = list(csv.DictReader(open(csv_path, newline="")))
    assert sorted(r["job_id"] for r in rows) == sorted(j for j, _ in jobs)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    measured = {}
    for row in rows:
        info = cluster.job_info(row["job_id"])
        log = sweep_dir / "logs" / f"epas-sweep-tiny-{row['job_id']}.out"
        assert row["status"] == "ok", f"{row}\n{log.read_text()[-3000:] if log.exists() else ''}"
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0"
        assert (row["preset"], row["tp"], row["pp"], row["mbs"]) == ("tiny", "1", "1", "2")
        sharing = REGIONS[row["region"]]
        assert row["sharing_layers"] == str(sharing) and row["num_layers"] == "4"
        assert (row["world_size"], row["nodes"], row["iterations"], row["timed_iterations"]) == ("1", "1", str(ITERS), str(ITERS - WARMUP))
        assert row["torch"] == version("torch") and row["megatron_core"] == version("megatron-core")
        assert row["git_commit"].split("-")[0] == head
        assert row["host"] in cluster.nodes and row["date"]

        tokens_per_s, records = independent_tokens_per_s(sweep_dir / "runs" / row["job_id"] / "metrics.jsonl", WARMUP)
        assert float(row["tokens_per_s"]) == pytest.approx(tokens_per_s, rel=1e-6)
        measured[row["region"]] = tokens_per_s
        # The region is in place from iteration 1, switched on in one step.
        switches = [r for r in records if r.get("kind") == "switch"]
        assert [(s["iteration"], len(s["sharing_layers"])) for s in switches] == ([(1, sharing)] if sharing else [])
        trained = [r for r in records if "kind" not in r]
        assert {len(r["sharing_layers"]) for r in trained} == {sharing}

    # The report (sweep.sh ran tools/sweep_report.py on the CSV once every point was done; its exit
    # status is the script's): a markdown table with the ratio to the baseline, and two PNG plots.
    markdown = (sweep_dir / "sweep_report.md").read_text()
    assert markdown in proc.stdout, proc.stdout[-3000:]  # written by that run, which printed it
    for name in ("sweep_tokens_per_s.png", "sweep_speedup.png"):
        assert f"wrote {sweep_dir.resolve() / name}" in proc.stdout.splitlines(), proc.stdout[-3000:]
    table = [line for line in markdown.splitlines() if line.startswith("| tiny |")]
    assert len(table) == 3
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        region, ratio = cells[7], cells[-1]
        expected = "baseline" if region == "0" else f"{measured[region] / measured['0']:.3f}x"
        assert ratio == expected, line
    for name in ("sweep_tokens_per_s.png", "sweep_speedup.png"):
        data = (sweep_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
