"""tools/sweep_record.py, tools/sweep_report.py and launch/run_progress.py without Slurm."""

from __future__ import annotations

import csv
import importlib.util
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


record = _load("epas_sweep_record", REPO / "tools" / "sweep_record.py")
report = _load("epas_sweep_report", REPO / "tools" / "sweep_report.py")
progress = _load("epas_run_progress", REPO / "launch" / "run_progress.py")


# ------------------------------------------------------------------------- region flags
@pytest.mark.parametrize(
    "preset, region, layers",
    [("tiny", "0", 0), ("tiny", "1", 1), ("tiny", "0.5", 2), ("tiny", "0.75", 3), ("125m", "0.5", 6), ("7b", "0.25", 8), ("1b", "0.5", 11)],
)
def test_region_flags_switch_the_whole_region_at_once(preset, region, layers):
    from epas_megatron.config.cli import parse_config
    from epas_megatron.validation import resolve_run

    flags = record.region_flags(preset, region)
    if layers == 0:
        assert flags == ["--epas-target-layers", "0"]
        return
    assert flags == ["--epas-target-layers", str(layers), "--epas-first-switch", str(record.FIRST_SWITCH), "--epas-interval", "1",
                     "--epas-growth", str(layers)]
    # The trainer's own schedule agrees: nothing before FIRST_SWITCH, the full region from it.
    cfg = parse_config(["--preset", preset, *flags, "--train-iters", "10", "--data", "embedded",  # as sweep_point.sbatch passes it
                        "--output-dir", "/nonexistent/epas-test"])
    schedule = resolve_run(cfg, world_size=1, cuda=False).schedule
    num_layers = cfg.model.num_layers
    assert schedule.sharing_layers(record.FIRST_SWITCH - 1) == ()
    assert schedule.sharing_layers(record.FIRST_SWITCH) == tuple(range(num_layers - layers, num_layers))
    assert schedule.final_iteration == record.FIRST_SWITCH


def test_region_flags_reject_a_region_without_source_layer():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "sweep_record.py"), "region-flags", "--preset", "tiny", "--region", "4"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "at least one layer must keep computing" in proc.stderr


def test_region_flags_check_the_region_with_the_trainers_other_flags():
    from epas_megatron.errors import ConfigError

    # 3 of tiny's 4 layers in 2 blocks: the trainer refuses it (--epas-blocks must divide the
    # target), so the sweep refuses it before anything is submitted, naming the flag.
    with pytest.raises(ConfigError, match="--epas-blocks 2 does not divide"):
        record.region_flags("tiny", "3", ["--epas-blocks", "2"])
    with pytest.raises(ConfigError, match="--epas-exclude-last 1"):
        record.region_flags("tiny", "3", ["--epas-exclude-last", "1"])
    assert record.region_flags("tiny", "2", ["--epas-exclude-last", "1"])[:2] == ["--epas-target-layers", "2"]


def test_region_table_gives_each_points_flags_and_refuses_the_grid_naming_a_bad_region(capsys):
    """sweep.sh checks the whole grid in one process and hands each point these flags."""
    assert record.main(["region-table", "--presets", "tiny 125m", "--regions", "0 0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [" ".join([preset, region, *record.region_flags(preset, region)])
                     for preset in ("tiny", "125m") for region in ("0", "0.5")]
    assert record.main(["region-table", "--presets", "tiny", "--regions", "2 3", "--", "--epas-blocks", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "error: region '3' for preset tiny: " in err and "--epas-blocks 2 does not divide" in err


# ------------------------------------------------------------------------- throughput
def write_metrics(path: Path, times: list[float], sharing: int = 2, tokens_per_iteration: int = 128) -> None:
    lines = [json.dumps({"kind": "switch", "iteration": 2, "sharing_layers": list(range(sharing))})]
    for i, t in enumerate(times, start=1):  # a region switched on at iteration 2
        lines.append(json.dumps({"iteration": i, "tokens_per_s": tokens_per_iteration / t, "iteration_time_s": t,
                                 "sharing_layers": list(range(sharing if i >= 2 else 0))}))
    path.write_text("\n".join(lines) + "\n")


def test_timed_throughput_skips_warmup(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, [9.0, 5.0, 0.5, 0.25, 0.25])
    tokens_per_s, count = record.timed_throughput(metrics, warmup=2, sharing_layers=2)
    assert count == 3 and tokens_per_s == pytest.approx(3 * 128 / 1.0)
    with pytest.raises(ValueError, match="ran with 0 sharing layers, expected 2"):
        record.timed_throughput(metrics, warmup=0, sharing_layers=2)


def _append_many(csv_path: str, worker: int, rows: int, barrier) -> None:
    barrier.wait()
    for i in range(rows):
        row = {column: f"{worker}-{i}" for column in record.COLUMNS}
        record.append_row(Path(csv_path), row)


def test_concurrent_appends_keep_one_header_and_whole_rows(tmp_path):
    csv_path = tmp_path / "sweep.csv"
    workers, rows = 6, 40
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_append_many, args=(str(csv_path), w, rows, barrier)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = csv_path.read_text().splitlines()
    assert lines[0] == ",".join(record.COLUMNS)
    assert sum(1 for line in lines if line == lines[0]) == 1
    parsed = list(csv.DictReader(open(csv_path, newline="")))
    assert len(parsed) == workers * rows
    assert all(len(set(row.values())) == 1 for row in parsed)  # no row mixes two writers
    assert {row["job_id"] for row in parsed} == {f"{w}-{i}" for w in range(workers) for i in range(rows)}


def test_append_records_a_failed_point(tmp_path):
    log = tmp_path / "point.log"
    log.write_text("[launch] command: torchrun ...\nerror: the run config does not fit 1 node(s): --tp 4 ...\n")
    csv_path = tmp_path / "sweep.csv"
    argv = ["append", "--csv", str(csv_path), "--log", str(log), "--metrics", str(tmp_path / "none.jsonl"), "--status", "2",
            "--job-id", "77", "--preset", "tiny", "--region", "0.5", "--tp", "4", "--pp", "1", "--mbs", "2"]
    assert record.main(argv) == 0
    (row,) = list(csv.DictReader(open(csv_path, newline="")))
    assert (row["job_id"], row["status"], row["tokens_per_s"], row["sharing_layers"]) == ("77", "failed", "", "2")
    assert row["error"].startswith("the run config does not fit")


def test_append_reads_summary_banner_and_metrics(tmp_path):
    log = tmp_path / "point.log"
    log.write_text(
        "epas-megatron: 4 layers, hidden 64, heads 4/2, ffn 176, vocab 512, seq 64 | world 2 = TP 1 x PP 1 x DP 2 "
        "| global batch 4 = 1 micro-batches x 2 x DP 2 | fp32\n"
        'SUMMARY {"iterations": 5, "final_lm_loss": 6.1, "tokens_per_s": 99.0, "exit_reason": "completed"}\n'
    )
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, [1.0, 1.0, 0.5, 0.5, 0.5], sharing=2, tokens_per_iteration=256)
    csv_path = tmp_path / "sweep.csv"
    argv = ["append", "--csv", str(csv_path), "--log", str(log), "--metrics", str(metrics), "--warmup", "2",
            "--job-id", "5", "--preset", "tiny", "--region", "0.5", "--tp", "1", "--pp", "1", "--mbs", "2", "--nodes", "2"]
    assert record.main(argv) == 0
    (row,) = list(csv.DictReader(open(csv_path, newline="")))
    assert row["status"] == "ok" and float(row["tokens_per_s"]) == pytest.approx(512.0)
    assert (row["world_size"], row["nproc_per_node"], row["gbs"], row["timed_iterations"], row["summary_tokens_per_s"]) == (
        "2", "1", "4", "3", "99.000")


# ------------------------------------------------------------------------- report
def make_row(job, region, sharing, tps, preset="tiny", mbs="2", status="ok", error=""):
    row = {c: "" for c in record.COLUMNS}
    row.update(job_id=job, preset=preset, region=region, sharing_layers=str(sharing), num_layers="4", tp="1", pp="1", mbs=mbs,
               gbs="2", seq_length="64", nodes="1", nproc_per_node="1", world_size="1", tokens_per_s=str(tps), status=status,
               error=error, torch="2.14.1", megatron_core="0.19.2", git_commit="abc")
    return row


def test_report_table_ratios_and_plots(tmp_path):
    csv_path = tmp_path / "sweep.csv"
    rows = [
        make_row(1, "0", 0, 1000), make_row(2, "0", 0, 1200), make_row(3, "0", 0, 1100),  # median 1100
        make_row(4, "0.5", 2, 1210), make_row(5, "1", 1, 1155),
        make_row(6, "0", 0, 500, mbs="4"), make_row(7, "0.5", 2, 550, mbs="4"),
        make_row(8, "0.5", 2, 999, mbs="8"),  # no baseline for mbs 8
        make_row(9, "0.5", 2, "", status="failed", error="out of memory"),
    ]
    for row in rows:
        record.append_row(csv_path, row)
    out = tmp_path / "report"
    assert report.main([str(csv_path), "--out-dir", str(out)]) == 0
    text = (out / "sweep_report.md").read_text()
    table = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| tiny")]
    got = {(r[4], r[7]): (r[9], r[10], r[11]) for r in table}
    assert got[("2", "0")] == ("1,100", "3", "baseline")
    assert got[("2", "0.5")] == ("1,210", "1", "1.100x")
    assert got[("2", "1")] == ("1,155", "1", "1.050x")
    assert got[("4", "0.5")] == ("550", "1", "1.100x")
    assert got[("8", "0.5")] == ("999", "1", "no baseline")
    assert "- job 9: tiny region 0.5 tp1 pp1 mbs2: out of memory" in text
    for name in ("sweep_tokens_per_s.png", "sweep_speedup.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------- run progress
def make_run(out: Path, train_iters: int, checkpoint: int | None, logged: int = 0, save: str | None = None) -> None:
    import yaml

    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump({"training": {"train_iters": train_iters}, "checkpoint": {"save": save}}))
    root = Path(save) if save else out / "checkpoints"
    if checkpoint is not None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "latest_checkpointed_iteration.txt").write_text(f"{checkpoint}\n")
    lines = [json.dumps({"iteration": i, "lm_loss": 1.0}) for i in range(1, logged + 1)]
    lines.append(json.dumps({"kind": "valid", "iteration": train_iters + 5}))  # not a training record
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n{truncated")


@pytest.mark.parametrize(
    "train_iters, checkpoint, logged, status",
    [(100, 37, 37, 3), (100, 100, 100, 0), (100, 90, 100, 0), (100, None, 12, 3), (100, None, 0, 3)],
    ids=["signalled", "finished", "no-save-final", "no-checkpoint-yet", "nothing-yet"],
)
def test_run_progress(tmp_path, train_iters, checkpoint, logged, status):
    make_run(tmp_path / "run", train_iters, checkpoint, logged)
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "run_progress.py"), str(tmp_path / "run")], capture_output=True, text=True)
    assert proc.returncode == status, proc.stdout + proc.stderr
    state = json.loads(proc.stdout.split("progress ", 1)[1])
    assert state["checkpoint_iteration"] == checkpoint and state["logged_iteration"] == logged


def test_run_progress_custom_save_dir_and_missing_run(tmp_path):
    make_run(tmp_path / "run", 10, 10, save=str(tmp_path / "elsewhere"))
    assert progress.progress(tmp_path / "run")["finished"]
    assert progress.main([str(tmp_path / "missing")]) == progress.NO_RUN
