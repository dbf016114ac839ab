"""Turn a throughput-sweep CSV (slurm/sweep.sh) into a markdown table and plots.

    python tools/sweep_report.py runs/sweep/sweep.csv [--out-dir DIR]

Writes ``sweep_report.md`` (also printed), ``sweep_tokens_per_s.png`` and ``sweep_speedup.png``
to ``--out-dir`` (default: the CSV's directory).

A *configuration* is everything but the region (preset, nodes x processes, TP, PP, micro-batch,
global batch, sequence length); its *baseline* is the row with no sharing layers. Repeated
points (several rows with the same configuration and region) are summarised by their median
tokens/s. "vs baseline" is EPAS tokens/s divided by the baseline's: > 1 means EPAS is faster.
Failed points are listed under the table and left out of the plots.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple, Optional


class ConfigKey(NamedTuple):
    """A sweep configuration without its region."""

    preset: str
    nodes: str
    world_size: str
    tp: str
    pp: str
    mbs: str
    gbs: str
    seq_length: str

    def label(self) -> str:
        return f"{self.preset} tp{self.tp} pp{self.pp} mbs{self.mbs} ({self.world_size} procs)"


class PointStats(NamedTuple):
    """Median throughput of one (configuration, region)."""

    key: ConfigKey
    region: str
    sharing_layers: int
    num_layers: Optional[int]
    tokens_per_s: float
    repeats: int
    baseline: Optional[float]

    @property
    def ratio(self) -> Optional[float]:
        return self.tokens_per_s / self.baseline if self.baseline else None


def _int(value: str, default: Optional[int] = None) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def summarise(rows: list[dict]) -> tuple[list[PointStats], list[dict]]:
    """(one PointStats per configuration and region, sorted; the failed rows)."""
    groups: dict[tuple[ConfigKey, int], list[dict]] = defaultdict(list)
    failed = []
    for row in rows:
        if row.get("status") != "ok" or not row.get("tokens_per_s"):
            failed.append(row)
            continue
        key = ConfigKey(*(row.get(field, "") for field in ConfigKey._fields))
        groups[(key, _int(row.get("sharing_layers"), 0))].append(row)
    medians = {k: statistics.median(float(r["tokens_per_s"]) for r in v) for k, v in groups.items()}
    stats = []
    for (key, sharing), group in groups.items():
        stats.append(
            PointStats(
                key=key,
                region=group[0].get("region", str(sharing)),
                sharing_layers=sharing,
                num_layers=_int(group[0].get("num_layers")),
                tokens_per_s=medians[(key, sharing)],
                repeats=len(group),
                baseline=medians.get((key, 0)),
            )
        )
    stats.sort(key=lambda s: (s.key.preset, _int(s.key.world_size, 0), _int(s.key.tp, 0), _int(s.key.pp, 0), _int(s.key.mbs, 0),
                              s.sharing_layers))
    return stats, failed


def markdown(stats: list[PointStats], failed: list[dict], source: str) -> str:
    lines = [
        f"# Throughput sweep ({source})",
        "",
        "| preset | procs | TP | PP | MBS | GBS | seq | region | sharing layers | tokens/s | runs | vs baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for s in stats:
        layers = f"{s.sharing_layers}/{s.num_layers}" if s.num_layers else str(s.sharing_layers)
        ratio = "baseline" if s.sharing_layers == 0 else (f"{s.ratio:.3f}x" if s.ratio is not None else "no baseline")
        k = s.key
        lines.append(f"| {k.preset} | {k.world_size} | {k.tp} | {k.pp} | {k.mbs} | {k.gbs} | {k.seq_length} | {s.region} | {layers} "
                     f"| {s.tokens_per_s:,.0f} | {s.repeats} | {ratio} |")
    if failed:
        lines += ["", f"Failed points ({len(failed)}):", ""]
        for row in failed:
            lines.append(f"- job {row.get('job_id', '?')}: {row.get('preset')} region {row.get('region')} "
                         f"tp{row.get('tp')} pp{row.get('pp')} mbs{row.get('mbs')}: {row.get('error') or 'no result'}")
    return "\n".join(lines) + "\n"


def plot(stats: list[PointStats], out_dir: Path) -> list[Path]:
    """Grouped bars of tokens/s per configuration, and the speed-up over the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(s.key for s in stats))
    regions = sorted({s.sharing_layers for s in stats})
    by = {(s.key, s.sharing_layers): s for s in stats}
    paths = []

    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(keys) + 2), 4.5))
    width = 0.8 / max(1, len(regions))
    for i, region in enumerate(regions):
        xs, ys = [], []
        for j, key in enumerate(keys):
            if (key, region) in by:
                xs.append(j + (i - (len(regions) - 1) / 2) * width)
                ys.append(by[(key, region)].tokens_per_s)
        ax.bar(xs, ys, width=width, label="baseline" if region == 0 else f"{region} sharing layers")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([k.label() for k in keys], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title("Training throughput by sharing region")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "sweep_tokens_per_s.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for key in keys:
        points = sorted((s.sharing_layers / s.num_layers if s.num_layers else s.sharing_layers, s.ratio)
                        for s in stats if s.key == key and s.ratio is not None)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key.label())
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("sharing layers / layers")
    ax.set_ylabel("tokens/s vs baseline")
    ax.set_title("EPAS speed-up over the baseline")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "sweep_speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path, help="the sweep CSV")
    parser.add_argument("--out-dir", type=Path, default=None, help="where the report and plots go (default: next to the CSV)")
    args = parser.parse_args(argv)
    if not args.csv.is_file():
        print(f"error: {args.csv}: no such file", file=sys.stderr)
        return 2
    rows = read_rows(args.csv)
    if not rows:
        print(f"error: {args.csv} has no rows", file=sys.stderr)
        return 2
    out_dir = args.out_dir or args.csv.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    stats, failed = summarise(rows)
    text = markdown(stats, failed, args.csv.name)
    env = sorted({(r.get("torch", ""), r.get("megatron_core", ""), r.get("git_commit", "")) for r in rows})
    text += "\n" + "\n".join(f"torch {t}, megatron-core {m}, commit {c or 'unknown'}" for t, m, c in env) + "\n"
    (out_dir / "sweep_report.md").write_text(text)
    print(text, end="")
    if stats:
        for path in plot(stats, out_dir):
            print(f"wrote {path}")
    else:
        print("no successful points: no plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
