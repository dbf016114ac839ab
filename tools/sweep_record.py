r"""Helpers for one point of a throughput sweep (``slurm/sweep_point.sbatch``).

    python tools/sweep_record.py region-flags --preset 125m --region 0.5
        -> --epas-target-layers 6 --epas-first-switch 1 --epas-interval 1 --epas-growth 6
    python tools/sweep_record.py region-table --presets "tiny 125m" --regions "0 0.5"
        -> one line per point: tiny 0 --epas-target-layers 0 / tiny 0.5 --epas-target-layers 2 ...
    python tools/sweep_record.py append --csv sweep.csv --log job.log \
        --metrics runs/sweep/runs/42/metrics.jsonl --warmup 5 --job-id 42 \
        --preset 125m --region 0.5 --tp 1 --pp 1 --mbs 8 --nodes 1

``region-flags`` fixes the EPAS region from the start: the whole region switches at iteration
:data:`FIRST_SWITCH` = 1 (``--epas-first-switch 1 --epas-interval 1 --epas-growth <region
layers>``), before the first step. Region 0 is the baseline (EPAS off). A region is a layer
count ('6') or a fraction of the layers ('0.5'), resolved with the trainer's own rule.

``region-table`` does the same for every preset and region of a sweep in one process (the
check imports torch and Megatron-Core: seconds per process), so that slurm/sweep.sh checks the
whole grid before it submits anything and hands each point its flags (``SWEEP_REGION_FLAGS``).

``append`` measures the point from the run's ``metrics.jsonl`` (logged every iteration):
tokens/s = tokens of the timed iterations / their summed ``iteration_time_s``, where the timed
iterations are those after ``--warmup`` (>= 1: the one-off costs of the first steps after
start-up and after the switch rebuild are left out). It also reads the trainer's start banner
(world size, global batch) and ``SUMMARY {json}`` line from the point's log, and appends one
row to the CSV under an exclusive ``flock`` on the CSV file, writing the header if the file is
empty, so concurrent jobs never interleave or duplicate headers. A point whose run failed still
gets a row (``status`` = ``failed``, the first ``error:`` line in ``error``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent

FIRST_SWITCH = 1
"""Iteration at which a sweep point's region is switched on: before the very first step, so
every iteration runs with the full region."""

COLUMNS = [
    "job_id", "preset", "region", "sharing_layers", "num_layers", "tp", "pp", "mbs", "gbs",
    "seq_length", "nodes", "nproc_per_node", "world_size", "iterations", "timed_iterations",
    "tokens_per_s", "summary_tokens_per_s", "final_lm_loss", "exit_reason", "status", "error",
    "torch", "megatron_core", "git_commit", "host", "date",
]
"""CSV columns, in order (the report reads them by name)."""


def _model_config(preset: str, extra: list[str]):
    from epas_megatron.config.cli import parse_config

    return parse_config(["--preset", preset, *extra])


def region_layers(preset: str, region: str, extra: Optional[list[str]] = None) -> tuple[int, int]:
    """(sharing layers, num_layers) for a region given as a count or a fraction; checked against
    the trainer flags in ``extra`` (e.g. ``--epas-exclude-last``) before anything is submitted."""
    from epas_megatron.sharing.schedule import resolve_target_layers
    from epas_megatron.validation import sharing_schedule

    num_layers = _model_config(preset, extra or []).model.num_layers
    layers = resolve_target_layers(region, num_layers)
    # The region as region_flags sets it up (one switch of all its layers) must be one the
    # trainer accepts with the other flags (--epas-exclude-last, --epas-blocks): its resolver's
    # schedule says so with the flags' names.
    sharing_schedule(_model_config(preset, [*(extra or []), *_flags_for(layers)]))
    return layers, num_layers


def region_flags(preset: str, region: str, extra: Optional[list[str]] = None) -> list[str]:
    """Trainer flags that put the whole region in place before iteration 1."""
    layers, _ = region_layers(preset, region, extra)
    return _flags_for(layers)


def _flags_for(layers: int) -> list[str]:
    if layers == 0:
        return ["--epas-target-layers", "0"]
    return ["--epas-target-layers", str(layers), "--epas-first-switch", str(FIRST_SWITCH), "--epas-interval", "1",
            "--epas-growth", str(layers)]


def timed_throughput(metrics: Path, warmup: int, sharing_layers: Optional[int] = None) -> tuple[Optional[float], int]:
    """(tokens/s over the training records with iteration > warmup, number of them).

    Each record's tokens are ``tokens_per_s * iteration_time_s`` (the record covers one
    iteration at --log-interval 1; a longer interval is weighted by its time all the same).
    Records whose sharing region differs from ``sharing_layers`` are an error (ValueError).
    """
    tokens, seconds, count = 0.0, 0.0, 0
    if not metrics.is_file():
        return None, 0
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "kind" in record or not isinstance(record.get("iteration"), int) or record["iteration"] <= warmup:
            continue
        if sharing_layers is not None and len(record.get("sharing_layers", [])) != sharing_layers:
            raise ValueError(f"iteration {record['iteration']} ran with {len(record.get('sharing_layers', []))} sharing layers, "
                             f"expected {sharing_layers}")
        tokens += float(record["tokens_per_s"]) * float(record["iteration_time_s"])
        seconds += float(record["iteration_time_s"])
        count += 1
    return (tokens / seconds if seconds > 0 else None), count


_BANNER = re.compile(r"\| world (?P<world>\d+) = TP \d+ x PP \d+.* \| global batch (?P<gbs>\d+) =")


def read_summary(log: Path) -> tuple[Optional[dict], str]:
    """The last ``SUMMARY {json}`` of a log, and the first ``error:`` line (or '').

    The world size and global batch of the trainer's start banner (``... | world 16 = TP 2 x
    PP 1 x DP 8 | global batch 256 = ...``) are added to the summary as ``world_size``/``gbs``.
    """
    summary, error, banner = None, "", {}
    if not log.is_file():
        return None, f"no log {log}"
    for line in log.read_text(errors="replace").splitlines():
        stripped = line.strip()
        match = _BANNER.search(stripped)
        if match:
            banner = {"world_size": int(match["world"]), "gbs": int(match["gbs"])}
        if stripped.startswith("SUMMARY "):
            try:
                summary = json.loads(stripped[len("SUMMARY "):])
            except ValueError:
                pass
        elif stripped.startswith("error:") and not error:
            error = stripped[len("error:"):].strip()
    if summary is not None:
        summary = {**banner, **summary}
    return summary, error


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return ""


def git_commit(repo: Path = REPO_ROOT) -> str:
    """Short HEAD commit, with '-dirty' when tracked files have changes."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               timeout=30)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return ""


def make_row(args, summary: Optional[dict], error: str, status_code: int) -> dict:
    """One CSV row for a sweep point (throughput from ``args.metrics`` after ``args.warmup``)."""
    config = None
    try:
        config = _model_config(args.preset, ["--tp", str(args.tp), "--pp", str(args.pp), "--micro-batch-size", str(args.mbs),
                                             *args.trainer_args])
    except Exception:  # the row is still worth writing
        pass
    sharing, num_layers = "", ""
    try:
        sharing, num_layers = region_layers(args.preset, args.region, args.trainer_args)
    except Exception:
        pass
    tokens_per_s, timed = None, 0
    if status_code == 0 and summary is not None:
        try:
            tokens_per_s, timed = timed_throughput(args.metrics, args.warmup, sharing if sharing != "" else None)
        except ValueError as e:
            error = str(e)
        if tokens_per_s is None and not error:
            error = f"no training records after iteration {args.warmup} in {args.metrics} (raise SWEEP_ITERS)"
    ok = status_code == 0 and summary is not None and tokens_per_s is not None
    world = (summary or {}).get("world_size") or (args.nodes * args.nproc_per_node if args.nproc_per_node else "")
    gbs = (summary or {}).get("gbs", "")
    if gbs == "" and config is not None:
        gbs = config.training.global_batch_size or ""
    return {
        "job_id": args.job_id,
        "preset": args.preset,
        "region": args.region,
        "sharing_layers": sharing,
        "num_layers": num_layers,
        "tp": args.tp,
        "pp": args.pp,
        "mbs": args.mbs,
        "gbs": gbs,
        "seq_length": config.training.seq_length if config is not None else "",
        "nodes": args.nodes,
        "nproc_per_node": world // args.nodes if isinstance(world, int) and args.nodes else "",
        "world_size": world,
        "iterations": summary.get("iterations", "") if summary else "",
        "timed_iterations": timed if ok else "",
        "tokens_per_s": f"{tokens_per_s:.3f}" if ok else "",
        "summary_tokens_per_s": f"{summary['tokens_per_s']:.3f}" if summary and summary.get("tokens_per_s") is not None else "",
        "final_lm_loss": summary.get("final_lm_loss", "") if summary else "",
        "exit_reason": summary.get("exit_reason", "") if summary else "",
        "status": "ok" if ok else "failed",
        "error": "" if ok else (error or f"exit status {status_code}")[:300],
        "torch": _version("torch"),
        "megatron_core": _version("megatron-core"),
        "git_commit": git_commit(),
        "host": os.environ.get("SLURM_JOB_NODELIST") or socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def append_row(csv_path: Path, row: dict) -> None:
    """Append ``row`` under an exclusive flock; write the header first if the file is empty."""
    from epas_megatron.runtime.fs import exclusive_lock

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore")
    with exclusive_lock(csv_path), open(csv_path, "a", newline="") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            writer.writeheader()
        writer.writerow(row)
        f.write(buffer.getvalue())
        f.flush()
        os.fsync(f.fileno())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    flags = sub.add_parser("region-flags", help="print the trainer flags for a fixed region")
    flags.add_argument("--preset", required=True)
    flags.add_argument("--region", required=True)
    flags.add_argument("trainer_args", nargs=argparse.REMAINDER, help="model flags that change the layer count")
    table = sub.add_parser("region-table", help="print 'preset region flags...' for every preset and region")
    table.add_argument("--presets", required=True, help="space-separated")
    table.add_argument("--regions", required=True, help="space-separated")
    table.add_argument("trainer_args", nargs=argparse.REMAINDER, help="model flags that change the layer count")
    app = sub.add_parser("append", help="append one point's row to the CSV")
    app.add_argument("--csv", required=True, type=Path)
    app.add_argument("--log", required=True, type=Path, help="the point's log with the SUMMARY line")
    app.add_argument("--metrics", required=True, type=Path, help="the point's metrics.jsonl (logged every iteration)")
    app.add_argument("--warmup", type=int, default=5, help="untimed iterations at the start (>= %d)" % FIRST_SWITCH)
    app.add_argument("--status", type=int, default=0, help="exit status of the training step")
    app.add_argument("--job-id", default=os.environ.get("SLURM_JOB_ID", ""))
    app.add_argument("--preset", required=True)
    app.add_argument("--region", required=True)
    app.add_argument("--tp", type=int, required=True)
    app.add_argument("--pp", type=int, required=True)
    app.add_argument("--mbs", type=int, required=True)
    app.add_argument("--nodes", type=int, default=1)
    app.add_argument("--nproc-per-node", type=int, default=0, help="only used when the log has no start banner")
    app.add_argument("trainer_args", nargs=argparse.REMAINDER, help="the extra trainer flags of the sweep")
    args = parser.parse_args(argv)
    if args.trainer_args and args.trainer_args[0] == "--":
        args.trainer_args = args.trainer_args[1:]

    from epas_megatron.errors import ConfigError

    if args.command == "region-flags":
        try:
            print(" ".join(region_flags(args.preset, args.region, args.trainer_args)))
        except ConfigError as e:
            print(f"error: region {args.region!r} for preset {args.preset}: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "region-table":
        lines = []
        for preset in args.presets.split():
            for region in args.regions.split():
                try:
                    lines.append(" ".join([preset, region, *region_flags(preset, region, args.trainer_args)]))
                except ConfigError as e:
                    print(f"error: region {region!r} for preset {preset}: {e}", file=sys.stderr)
                    return 2
        print("\n".join(lines))
        return 0
    if args.warmup < FIRST_SWITCH:
        parser.error(f"--warmup must be >= {FIRST_SWITCH} (iteration {FIRST_SWITCH} pays for start-up and the switch)")
    summary, error = read_summary(args.log)
    row = make_row(args, summary, error, args.status)
    append_row(args.csv, row)
    print(f"sweep row -> {args.csv}: "
          + json.dumps({k: row[k] for k in ('job_id', 'preset', 'region', 'tp', 'pp', 'mbs', 'tokens_per_s', 'status')}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
