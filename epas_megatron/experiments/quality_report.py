"""The quality recipe's numbers, tables and plots, as pure functions of the runs' records.

Every input is what a training run writes (``metrics.jsonl`` records and the ``SUMMARY``) or
what ``epas-eval`` prints (``EVAL {json}``); nothing here runs a model, so each figure of the
report can be checked by hand against those files.

Definitions (the README states them with the measured tables):

* **Final validation loss**: the loss of the last evaluation of a run, with the region in
  training at that moment (the trained region for EPAS).
* **Gap**: EPAS final validation loss minus the baseline's (the paper bounds it at +0.05).
* **Training time**: seconds spent in training steps and EPAS switches, not in evaluation or
  checkpoint saves (``train_time_s`` of the records): evaluations at several regions would
  otherwise charge EPAS for measuring it.
* **Time to target**: the training time at which a run's validation loss first reaches the
  target (the baseline's final validation loss), linearly interpolated between the two
  evaluations around the crossing; ``None`` if it never does.
* **Throughput**: tokens per second over the whole run (``SUMMARY``: the first step and the
  first step after each rebuild left out) and, for EPAS, over the iterations trained with the
  final region only (steady state), against the baseline over the same iterations.
* **Post-switch jump**: for a switch at iteration ``t`` (the ``"kind": "switch"`` records), the
  first validation at an iteration ``>= t`` (after the switch) minus the last one at an
  iteration ``< t`` (before it), both with the region in training. The evaluations around a
  switch are ``--eval-interval`` apart, so the raw jump also contains that much training; the
  jump *against the baseline* subtracts the baseline's change between the same two iterations.
* **Seed spread**: the largest minus the smallest final validation loss of one method over the
  seeds; a difference smaller than it cannot be told apart from seed noise.
* **Best-interval throughput** (``--parts moc``): the largest tokens/s of a run's logging
  intervals (its training records); on a machine shared with other jobs it is a steadier measure
  of the run's own speed than the whole run's.
* **Perplexity change** (``--parts moc``): two runs whose final validation losses differ by
  ``d`` have perplexities in the ratio ``exp(d)``; the change is ``exp(d) - 1`` (the paper reports
  perplexities), over seeds ``exp(mean d) - 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

PAPER_GAP_BOUND = 0.05
"""The largest final-validation-loss gap the paper reports between EPAS and the baseline."""

PAPER_PROGRESSIVE_CLAIM = ("progressive growth of the region is what keeps EPAS's quality (the abstract: \"emphasizing the "
                           "significance of progressive training\"), so fixed minus progressive should be > 0; no figure of "
                           "the paper's is compared here.")
"""What the progressive-vs-fixed ablation checks (the sign of fixed minus progressive)."""

PAPER_BLOCKS_CLAIM = ("one contiguous sharing block beats several smaller ones with the same number of sharing layers "
                      "(the paper's ablation), so blocks minus one block should be > 0; no figure of the paper's is compared here.")
"""What the one-block-vs-several ablation checks (the sign of several blocks minus one block)."""


@dataclass
class ArmResult:
    """One training run of the recipe, as read back from its output directory."""

    name: str
    """Arm name (``baseline``, ``epas``, ...)."""

    summary: dict
    """The run's ``SUMMARY`` object."""

    records: list = field(default_factory=list)
    """Its ``metrics.jsonl`` records."""

    @property
    def valid_in_training(self) -> list[dict]:
        """Validation records of the region in training, by iteration."""
        rows = [r for r in self.records if r.get("kind") == "valid" and r.get("in_training", True)]
        return sorted(rows, key=lambda r: r["iteration"])

    def valid_curve(self, region: Optional[int] = None) -> list[dict]:
        """Validation records at one region size (None: the region in training)."""
        if region is None:
            return self.valid_in_training
        rows = [r for r in self.records if r.get("kind") == "valid" and r.get("region") == region]
        return sorted(rows, key=lambda r: r["iteration"])

    @property
    def train_records(self) -> list[dict]:
        """Periodic training records, by iteration."""
        return sorted((r for r in self.records if "kind" not in r), key=lambda r: r["iteration"])

    @property
    def final_valid_loss(self) -> float:
        rows = self.valid_in_training
        if not rows:
            raise ValueError(f"arm {self.name!r} has no validation record (is --eval-interval set?)")
        return rows[-1]["lm_loss"]

    @property
    def switch_iterations(self) -> list[int]:
        """Iterations of the run's EPAS switches (its ``"kind": "switch"`` records)."""
        return sorted(r["iteration"] for r in self.records if r.get("kind") == "switch")

    @property
    def train_time_s(self) -> float:
        return float(self.summary["train_time_s"])

    @property
    def tokens_per_s(self) -> Optional[float]:
        return self.summary.get("tokens_per_s")


def time_to_target(points: Sequence[tuple[float, float]], target: float) -> Optional[float]:
    """First time at which ``loss <= target`` along ``points`` ((time, loss) in time order),
    linearly interpolated between the evaluation before and the one reaching it; the first
    point's time if it already does; None if no point does."""
    previous = None
    for time_s, loss in points:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(time_s)
            t0, l0 = previous
            return float(t0 + (time_s - t0) * (l0 - target) / (l0 - loss))
        previous = (time_s, loss)
    return None


def steady_state_tokens_per_s(arm: ArmResult, after_iteration: int) -> Optional[float]:
    """Tokens/s over the logging intervals that start at or after ``after_iteration`` (total
    tokens over total step time; an interval covers the iterations since the previous record)."""
    seconds = tokens = 0.0
    previous = 0
    for row in arm.train_records:
        count = row["iteration"] - previous
        if previous >= after_iteration and row.get("iteration_time_s"):
            seconds += count * row["iteration_time_s"]
            tokens += count * row["iteration_time_s"] * row["tokens_per_s"]  # = count x tokens per iteration
        previous = row["iteration"]
    return tokens / seconds if seconds else None


def scratch_comparison(baseline: ArmResult, epas: ArmResult, full_region_from: int) -> dict:
    """The from-scratch numbers: final losses, gap, throughput, time to the baseline's loss."""
    target = baseline.final_valid_loss
    curve = lambda arm: [(r["train_time_s"], r["lm_loss"]) for r in arm.valid_in_training]
    gap = epas.final_valid_loss - target
    steady_base = steady_state_tokens_per_s(baseline, full_region_from)
    steady_epas = steady_state_tokens_per_s(epas, full_region_from)
    return {
        "baseline_final_valid_loss": target,
        "epas_final_valid_loss": epas.final_valid_loss,
        "gap": gap,
        "within_paper_bound": gap <= PAPER_GAP_BOUND,
        "baseline_tokens_per_s": baseline.tokens_per_s,
        "epas_tokens_per_s": epas.tokens_per_s,
        "tokens_per_s_ratio": _ratio(epas.tokens_per_s, baseline.tokens_per_s),
        "steady_state_from_iteration": full_region_from,
        "baseline_steady_tokens_per_s": steady_base,
        "epas_steady_tokens_per_s": steady_epas,
        "steady_tokens_per_s_ratio": _ratio(steady_epas, steady_base),
        "baseline_train_time_s": baseline.train_time_s,
        "epas_train_time_s": epas.train_time_s,
        "train_time_ratio": _ratio(epas.train_time_s, baseline.train_time_s),
        "baseline_time_to_target_s": time_to_target(curve(baseline), target),
        "epas_time_to_target_s": time_to_target(curve(epas), target),
    }


def continual_comparison(epas_eval: Sequence[dict], baseline_eval: Sequence[dict]) -> dict:
    """Validation loss against region for the EPAS continual run and the baseline continual run
    with inference-time sharing; the gap of each at the largest region to its own region 0."""
    epas = {r["region"]: r["lm_loss"] for r in epas_eval}
    base = {r["region"]: r["lm_loss"] for r in baseline_eval}
    regions = sorted(set(epas) & set(base))
    top = regions[-1]
    return {
        "regions": regions,
        "epas": [epas[r] for r in regions],
        "baseline_inference_sharing": [base[r] for r in regions],
        "epas_gap_at_max_region": epas[top] - epas[0],
        "baseline_gap_at_max_region": base[top] - base[0],
        "epas_degrades_less": (epas[top] - epas[0]) < (base[top] - base[0]),
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _num(value: Optional[float], fmt: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, fmt)


def _time(seconds: Optional[float]) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f} s"


def scratch_table(result: dict) -> str:
    """Markdown: one row per arm (baseline, EPAS) of the from-scratch comparison."""
    r = result
    lines = [
        "| arm | final val loss | gap vs baseline | tokens/s (run) | tokens/s (full region) | training time "
        "| time to baseline's final loss |",
        "|---|---|---|---|---|---|---|",
        f"| baseline | {_num(r['baseline_final_valid_loss'])} | | {_num(r['baseline_tokens_per_s'], '.0f')} | "
        f"{_num(r['baseline_steady_tokens_per_s'], '.0f')} | {_time(r['baseline_train_time_s'])} | "
        f"{_time(r['baseline_time_to_target_s'])} |",
        f"| EPAS | {_num(r['epas_final_valid_loss'])} | {r['gap']:+.4f} | {_num(r['epas_tokens_per_s'], '.0f')} "
        f"({_num(r['tokens_per_s_ratio'], '.3f')}x) | {_num(r['epas_steady_tokens_per_s'], '.0f')} "
        f"({_num(r['steady_tokens_per_s_ratio'], '.3f')}x) | {_time(r['epas_train_time_s'])} "
        f"({_num(r['train_time_ratio'], '.3f')}x) | {_time(r['epas_time_to_target_s'])} |",
    ]
    return "\n".join(lines)


def run_flops(arm: ArmResult) -> Optional[float]:
    """Model FLOPs of the whole run, from its training records: each record's TFLOP/s per
    device is the mean FLOPs of its interval's iterations over their time, so
    ``TFLOP/s x 1e12 x s/iter x devices x iterations`` gives them back. None without records."""
    records = arm.train_records
    if not records:
        return None
    world = arm.summary.get("world_size", 1)
    total, previous = 0.0, 0
    for record in records:
        total += record["tflops_per_device"] * 1e12 * record["iteration_time_s"] * world * (record["iteration"] - previous)
        previous = record["iteration"]
    return total


def methods_comparison(arms: Sequence[ArmResult]) -> list[dict]:
    """One row per arm, the first (the baseline) the reference: final validation loss at the
    same tokens, its difference, throughput and training time ratios, and the run's FLOP-limit
    ratio (baseline run FLOPs / the arm's)."""
    base = arms[0]
    base_flops = run_flops(base)
    rows = []
    for arm in arms:
        loss, flops = arm.final_valid_loss, run_flops(arm)
        rows.append({
            "arm": arm.name, "final_valid_loss": loss, "vs_baseline": loss - base.final_valid_loss,
            "tokens": arm.summary.get("iterations", 0) * arm.summary.get("global_batch_size", 0) * arm.summary.get("seq_length", 0),
            "tokens_per_s": arm.tokens_per_s, "tokens_per_s_ratio": _ratio(arm.tokens_per_s, base.tokens_per_s),
            "train_time_s": arm.train_time_s, "train_time_ratio": _ratio(arm.train_time_s, base.train_time_s),
            "run_flops": flops, "flop_limit_ratio": _ratio(base_flops, flops),
        })
    return rows


def methods_table(rows: Sequence[dict]) -> str:
    """Markdown of :func:`methods_comparison`."""
    lines = ["| arm | tokens | final val loss | vs baseline | tokens/s (run) | training time | FLOP-limit ratio (run) |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        versus = "" if i == 0 else f"{r['vs_baseline']:+.4f}"
        lines.append(f"| {r['arm']} | {r['tokens']} | {_num(r['final_valid_loss'])} | {versus} | {_num(r['tokens_per_s'], '.0f')} "
                     f"({_num(r['tokens_per_s_ratio'], '.3f')}x) | {_time(r['train_time_s'])} ({_num(r['train_time_ratio'], '.3f')}x) | "
                     f"{_num(r['flop_limit_ratio'], '.3f')} |")
    return "\n".join(lines)


def ablation_table(rows: Sequence[tuple[str, float]], reference: float) -> str:
    """Markdown: final validation loss per arm and its difference to ``reference``."""
    lines = ["| arm | final val loss | vs baseline |", "|---|---|---|"]
    lines += [f"| {name} | {loss:.4f} | {loss - reference:+.4f} |" for name, loss in rows]
    return "\n".join(lines)


def continual_table(result: dict) -> str:
    """Markdown: validation loss per region, EPAS continual pretraining against the baseline
    continual pretraining run with inference-time sharing (the paper's TinyLLaMA table shape)."""
    lines = ["| region | EPAS continual pretraining | baseline + inference-time sharing |", "|---|---|---|"]
    e0, b0 = result["epas"][0], result["baseline_inference_sharing"][0]
    for region, e, b in zip(result["regions"], result["epas"], result["baseline_inference_sharing"]):
        lines.append(f"| {region} | {e:.4f} ({e - e0:+.4f}) | {b:.4f} ({b - b0:+.4f}) |")
    return "\n".join(lines)


def plot_curves(arms: Sequence[ArmResult], path_tokens: str, path_time: str, tokens_per_iteration: int) -> None:
    """Validation loss (region in training) of each arm against tokens and against training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for path, x_of, label in (
        (path_tokens, lambda r: r["iteration"] * tokens_per_iteration / 1e6, "tokens (millions)"),
        (path_time, lambda r: r["train_time_s"] / 60, "training time (minutes; steps and switches)"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for arm in arms:
            rows = arm.valid_in_training
            ax.plot([x_of(r) for r in rows], [r["lm_loss"] for r in rows], marker="o", markersize=3, label=arm.name)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def plot_continual(result: dict, path: str) -> None:
    """Validation loss against region for both continual-pretraining arms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(result["regions"], result["epas"], marker="o", label="EPAS continual pretraining")
    ax.plot(result["regions"], result["baseline_inference_sharing"], marker="s", label="baseline + inference-time sharing")
    ax.set_xlabel("sharing region at inference (layers)")
    ax.set_ylabel("validation loss")
    ax.set_xticks(result["regions"])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def seed_summary(per_seed: Sequence[dict]) -> dict:
    """The from-scratch comparison over seeds: gaps, their mean, and the seed-to-seed spread of
    each method's final loss (what a gap must exceed to be told apart from noise)."""
    gaps = [r["gap"] for r in per_seed]
    spread = lambda key: (max(r[key] for r in per_seed) - min(r[key] for r in per_seed)) if len(per_seed) > 1 else None
    mean = lambda key: (sum(r[key] for r in per_seed) / len(per_seed)) if all(r[key] is not None for r in per_seed) else None
    mean_gap = sum(gaps) / len(gaps)
    return {
        "seeds": [r["seed"] for r in per_seed],
        "gaps": gaps,
        "mean_gap": mean_gap,
        "within_paper_bound": mean_gap <= PAPER_GAP_BOUND,
        "baseline_seed_spread": spread("baseline_final_valid_loss"),
        "epas_seed_spread": spread("epas_final_valid_loss"),
        "mean_tokens_per_s_ratio": mean("tokens_per_s_ratio"),
        "mean_steady_tokens_per_s_ratio": mean("steady_tokens_per_s_ratio"),
        "mean_train_time_ratio": mean("train_time_ratio"),
    }


def seed_summary_text(summary: dict) -> str:
    """One paragraph: the gap per seed and on average, against the paper's bound and the noise."""
    gaps = ", ".join(f"{g:+.4f} (seed {s})" for g, s in zip(summary["gaps"], summary["seeds"]))
    verdict = "within" if summary["within_paper_bound"] else "outside"
    text = (f"Final validation loss gap, EPAS minus baseline: {gaps}; mean {summary['mean_gap']:+.4f}, {verdict} the "
            f"paper's bound of +{PAPER_GAP_BOUND:.2f}.")
    if summary["baseline_seed_spread"] is not None:
        text += (f" Seed-to-seed spread of the final loss: baseline {summary['baseline_seed_spread']:.4f}, "
                 f"EPAS {summary['epas_seed_spread']:.4f}.")
    if summary["mean_tokens_per_s_ratio"] is not None:
        text += (f" Throughput, EPAS over baseline, mean over seeds: {summary['mean_tokens_per_s_ratio']:.3f}x over the "
                 f"whole run, {_num(summary['mean_steady_tokens_per_s_ratio'], '.3f')}x with the full region; "
                 f"training time {summary['mean_train_time_ratio']:.3f}x.")
    return text


def continual_verdict(result: dict) -> str:
    """Whether EPAS-trained weights keep their loss at the largest region better than weights
    trained without EPAS and shared only at inference (the paper's TinyLLaMA claim)."""
    top = result["regions"][-1]
    e, b = result["epas_gap_at_max_region"], result["baseline_gap_at_max_region"]
    holds = "holds here" if result["epas_degrades_less"] else "does NOT hold here"
    ratio = f" ({b / e:.1f}x less degradation)" if e > 0 and b > e else ""
    return (f"At region {top}, EPAS continual pretraining is {e:+.4f} from its own region-0 loss; the baseline with "
            f"inference-time sharing is {b:+.4f} from its own{ratio}. The paper's claim (EPAS keeps its quality when "
            f"run with a sharing region, inference-time sharing does not) {holds}.")


def _spread(values: Sequence[float]) -> Optional[float]:
    return max(values) - min(values) if len(values) > 1 else None


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def switch_jumps(arm: ArmResult, baseline: Optional[ArmResult] = None) -> list[dict]:
    """The validation loss around each switch of ``arm`` (see the module doc): per switch its
    ``iteration``, the ``before`` / ``after`` evaluations (iteration and loss), ``jump`` = after
    - before and, given ``baseline``, ``jump_vs_baseline`` = the jump minus the baseline's change
    between the same iterations (None where the baseline has no evaluation there). A switch
    without an evaluation on both sides is left out (one before the first evaluation, e.g.)."""
    valid = arm.valid_in_training
    base = {r["iteration"]: r["lm_loss"] for r in baseline.valid_in_training} if baseline is not None else {}
    rows = []
    for t in arm.switch_iterations:
        before = [r for r in valid if r["iteration"] < t]
        after = [r for r in valid if r["iteration"] >= t]
        if not before or not after:
            continue
        b, a = before[-1], after[0]
        row = {"iteration": t, "before_iteration": b["iteration"], "before": b["lm_loss"], "after_iteration": a["iteration"],
               "after": a["lm_loss"], "jump": a["lm_loss"] - b["lm_loss"]}
        if baseline is not None:
            known = b["iteration"] in base and a["iteration"] in base
            row["jump_vs_baseline"] = row["jump"] - (base[a["iteration"]] - base[b["iteration"]]) if known else None
        rows.append(row)
    return rows


def paired_comparison(baseline: ArmResult, reference: ArmResult, variant: ArmResult, names: tuple[str, str]) -> dict:
    """An ablation (one seed): the final losses of the baseline, the ``reference`` EPAS run and its
    ``variant``, the variant minus the reference (positive when the reference is better) and each
    gap to the baseline. ``names`` (reference, variant) prefix the keys."""
    ref, var = names
    target = baseline.final_valid_loss
    return {
        "baseline_final_valid_loss": target,
        f"{ref}_final_valid_loss": reference.final_valid_loss,
        f"{var}_final_valid_loss": variant.final_valid_loss,
        f"{var}_minus_{ref}": variant.final_valid_loss - reference.final_valid_loss,
        f"{ref}_gap": reference.final_valid_loss - target,
        f"{var}_gap": variant.final_valid_loss - target,
        f"{ref}_train_time_s": reference.train_time_s,
        f"{var}_train_time_s": variant.train_time_s,
    }


def paired_summary(per_seed: Sequence[dict], names: tuple[str, str], claim: str) -> dict:
    """:func:`paired_comparison` over seeds: the mean difference against the seed spreads; the paper
    agrees when the reference is better (a positive mean)."""
    ref, var = names
    differences = [r[f"{var}_minus_{ref}"] for r in per_seed]
    mean = sum(differences) / len(differences)
    spreads = {key: _spread([r[f"{key}_final_valid_loss"] for r in per_seed]) for key in ("baseline", ref, var)}
    largest = max((v for v in spreads.values() if v is not None), default=None)
    return {
        "seeds": [r["seed"] for r in per_seed],
        f"{var}_minus_{ref}": differences,
        f"mean_{var}_minus_{ref}": mean,
        "agrees_with_paper": mean > 0,
        **{f"{key}_seed_spread": value for key, value in spreads.items()},
        "exceeds_seed_spread": None if largest is None else abs(mean) > largest,
        "paper_claim": claim,
    }


def paired_table(per_seed: Sequence[dict], names: tuple[str, str], labels: tuple[str, str]) -> str:
    """Markdown: one row per seed of :func:`paired_comparison`; ``labels`` name the two EPAS runs."""
    ref, var = names
    lines = [f"| seed | baseline | {labels[0]} (gap) | {labels[1]} (gap) | {var.replace('_', ' ')} - {ref.replace('_', ' ')} |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['baseline_final_valid_loss']:.4f} | {r[f'{ref}_final_valid_loss']:.4f} "
              f"({r[f'{ref}_gap']:+.4f}) | {r[f'{var}_final_valid_loss']:.4f} ({r[f'{var}_gap']:+.4f}) | "
              f"{r[f'{var}_minus_{ref}']:+.4f} |" for r in per_seed]
    return "\n".join(lines)


def paired_summary_text(summary: dict, names: tuple[str, str], title: str) -> str:
    """One paragraph: the measured difference beside the paper's claim and the seed spread."""
    ref, var = names
    differences = ", ".join(f"{d:+.4f} (seed {s})" for d, s in zip(summary[f"{var}_minus_{ref}"], summary["seeds"]))
    reference = ref.replace("_", " ")
    text = (f"{title} final validation loss: {differences}; mean {summary[f'mean_{var}_minus_{ref}']:+.4f}. "
            f"The paper's claim: {summary['paper_claim']} Measured: "
            + (f"{reference} is better (agrees)." if summary["agrees_with_paper"] else f"{reference} is NOT better (disagrees)."))
    if summary["exceeds_seed_spread"] is not None:
        text += (f" Seed spread of the final loss: baseline {summary['baseline_seed_spread']:.4f}, {reference} "
                 f"{summary[f'{ref}_seed_spread']:.4f}, {var.replace('_', ' ')} {summary[f'{var}_seed_spread']:.4f}; "
                 "the mean difference is " + ("larger than every spread." if summary["exceeds_seed_spread"] else "within the seed noise."))
    else:
        text += " One seed: no spread to compare with."
    return text


FIXED = ("progressive", "fixed")
"""Key prefixes of the progressive-vs-fixed ablation (``--parts fixed``)."""

BLOCKS = ("one_block", "blocks")
"""Key prefixes of the one-block-vs-several ablation (``--parts blocks``)."""


@dataclass(frozen=True)
class SwitchRemedy:
    """A remedy for the validation loss jump at a switch (``--parts`` of its name): EPAS with one
    more epas-train flag of N iterations, against plain EPAS and the baseline. The paper has no
    such remedy and no claim about one."""

    name: str
    """Its ``--parts`` name, arm (``scratch_<name>``) and the prefix of its report keys."""

    flag: str
    """The epas-train flag (followed by N)."""

    title: str
    """Its report sections' title."""

    label: str
    """Its row in the tables."""

    short: str
    """Its name in running text."""

    cost: str
    """What it costs, in running text."""


REWARM = SwitchRemedy("rewarm", "--epas-switch-rewarm", "LR re-warm after each switch", "EPAS + LR re-warm", "re-warm",
                      "no FLOPs change")
"""The learning-rate re-warm after each switch (``--parts rewarm``)."""

RAMP = SwitchRemedy("ramp", "--epas-switch-ramp", "Blended switch, Q/K ramped onto the source's before each switch",
                    "EPAS + blended switch", "ramp", "two multiply-adds per blended Q/K element")
"""The blended switch (``--parts ramp``): the switching layers' Q/K blended into their source's
over the N iterations before each switch."""

REMEDIES = (REWARM, RAMP)
"""Every switch remedy, in the order the report gives them."""


def remedy_comparison(baseline: ArmResult, epas: ArmResult, remedied: ArmResult, name: str) -> dict:
    """EPAS with a switch remedy (``name``, the prefix of its keys) against plain EPAS and the
    baseline (one seed): final losses and gaps, the training time to the baseline's final loss,
    the post-switch jumps."""
    target = baseline.final_valid_loss
    curve = lambda arm: [(r["train_time_s"], r["lm_loss"]) for r in arm.valid_in_training]
    jumps = {key: switch_jumps(arm, baseline) for key, arm in (("epas", epas), (name, remedied))}
    result = {
        "baseline_final_valid_loss": target,
        "epas_final_valid_loss": epas.final_valid_loss,
        f"{name}_final_valid_loss": remedied.final_valid_loss,
        "epas_gap": epas.final_valid_loss - target,
        f"{name}_gap": remedied.final_valid_loss - target,
        f"{name}_minus_epas": remedied.final_valid_loss - epas.final_valid_loss,
        "baseline_time_to_target_s": time_to_target(curve(baseline), target),
        "epas_time_to_target_s": time_to_target(curve(epas), target),
        f"{name}_time_to_target_s": time_to_target(curve(remedied), target),
        "epas_train_time_s": epas.train_time_s,
        f"{name}_train_time_s": remedied.train_time_s,
    }
    for key, rows in jumps.items():
        result[f"{key}_jumps"] = rows
        result[f"{key}_max_jump"] = max((r["jump"] for r in rows), default=None)
        result[f"{key}_mean_jump_vs_baseline"] = _mean([r["jump_vs_baseline"] for r in rows])
    return result


def remedy_summary(per_seed: Sequence[dict], name: str) -> dict:
    """:func:`remedy_comparison` over seeds: mean gaps and jumps against the baseline's seed spread."""
    mean = lambda key: _mean([r[key] for r in per_seed])
    spread = _spread([r["baseline_final_valid_loss"] for r in per_seed])
    gap = mean(f"{name}_gap")
    return {
        "seeds": [r["seed"] for r in per_seed],
        "epas_gaps": [r["epas_gap"] for r in per_seed],
        f"{name}_gaps": [r[f"{name}_gap"] for r in per_seed],
        "mean_epas_gap": mean("epas_gap"),
        f"mean_{name}_gap": gap,
        f"mean_{name}_minus_epas": mean(f"{name}_minus_epas"),
        "baseline_seed_spread": spread,
        f"{name}_gap_within_seed_spread": None if spread is None else abs(gap) <= spread,
        "mean_epas_max_jump": mean("epas_max_jump"),
        f"mean_{name}_max_jump": mean(f"{name}_max_jump"),
        "mean_epas_jump_vs_baseline": mean("epas_mean_jump_vs_baseline"),
        f"mean_{name}_jump_vs_baseline": mean(f"{name}_mean_jump_vs_baseline"),
        f"{name}_reaches_target": [r[f"{name}_time_to_target_s"] is not None for r in per_seed],
    }


def remedy_table(result: dict, remedy: SwitchRemedy) -> str:
    """Markdown: baseline, EPAS and EPAS with the remedy of one seed, with the jump after each switch."""
    def jumps(rows: Sequence[dict]) -> str:
        return ", ".join(f"{r['iteration']}: {r['jump']:+.4f}" + (f" ({r['jump_vs_baseline']:+.4f})" if r.get("jump_vs_baseline")
                                                                is not None else "") for r in rows) or "n/a"

    r, n = result, remedy.name
    lines = ["| arm | final val loss | gap vs baseline | time to baseline's final loss | jump after each switch (vs baseline) |",
             "|---|---|---|---|---|",
             f"| baseline | {r['baseline_final_valid_loss']:.4f} | | {_time(r['baseline_time_to_target_s'])} | |",
             f"| EPAS | {r['epas_final_valid_loss']:.4f} | {r['epas_gap']:+.4f} | {_time(r['epas_time_to_target_s'])} | "
             f"{jumps(r['epas_jumps'])} |",
             f"| {remedy.label} | {r[f'{n}_final_valid_loss']:.4f} | {r[f'{n}_gap']:+.4f} | "
             f"{_time(r[f'{n}_time_to_target_s'])} | {jumps(r[f'{n}_jumps'])} |"]
    return "\n".join(lines)


def remedy_summary_text(summary: dict, remedy: SwitchRemedy, steps: int) -> str:
    """One paragraph: the remedy's gap and jumps against plain EPAS and the seed spread."""
    n, short = remedy.name, remedy.short
    gaps = ", ".join(f"{g:+.4f} (seed {s})" for g, s in zip(summary[f"{n}_gaps"], summary["seeds"]))
    text = (f"EPAS with {remedy.flag} {steps} ({remedy.cost}; a remedy beyond the paper, which makes no claim about it): "
            f"gap to the baseline {gaps}; mean {summary[f'mean_{n}_gap']:+.4f} against plain EPAS's "
            f"{summary['mean_epas_gap']:+.4f} ({short} minus plain {summary[f'mean_{n}_minus_epas']:+.4f}). Largest jump "
            f"after a switch, mean over seeds: {_num(summary[f'mean_{n}_max_jump'], '+.4f')} with the {short}, "
            f"{_num(summary['mean_epas_max_jump'], '+.4f')} without; against the baseline "
            f"{_num(summary[f'mean_{n}_jump_vs_baseline'], '+.4f')} vs {_num(summary['mean_epas_jump_vs_baseline'], '+.4f')} "
            "(mean over switches).")
    if summary["baseline_seed_spread"] is not None:
        inside = "within" if summary[f"{n}_gap_within_seed_spread"] else "outside"
        text += f" The {short}'s mean gap is {inside} the baseline's seed spread ({summary['baseline_seed_spread']:.4f})."
    reached = sum(summary[f"{n}_reaches_target"])
    text += f" It reaches the baseline's final loss in {reached} of {len(summary['seeds'])} seed(s)."
    return text


PAPER_MOC_PERPLEXITY = {"60M": (28.71, 29.11), "130M": (21.47, 21.76), "350M": (16.02, 16.18)}
"""The paper's C4 validation perplexity, dense and Mixture-of-Channels at K = 20% of the SwiGLU
channels, per LLaMA model size (Wu et al., "Mixture-of-Channels", arXiv 2511.09323)."""

PAPER_MOC_PERPLEXITY_CHANGE = {size: moc / dense - 1 for size, (dense, moc) in PAPER_MOC_PERPLEXITY.items()}
"""What MoC costs in the paper, per model size: perplexity ratio minus 1 (+1.0% to +1.4%)."""

MOC_ARMS = (("baseline", "baseline"), ("moc", "MoC"), ("epas", "EPAS"), ("epas_moc", "EPAS + MoC"))
"""Key prefix and table label of the four arms of ``--parts moc``, in table order."""


def perplexity_change(loss_difference: float) -> float:
    """The perplexity ratio minus 1 of two runs whose (mean per-token) losses differ by
    ``loss_difference``: ``exp(difference) - 1``."""
    return math.exp(loss_difference) - 1


def best_interval_tokens_per_s(arm: ArmResult) -> Optional[float]:
    """The largest tokens/s of the run's logging intervals (see the module doc); None without
    training records."""
    return max((r["tokens_per_s"] for r in arm.train_records if r.get("tokens_per_s")), default=None)


def moc_comparison(baseline: ArmResult, moc: ArmResult, epas: ArmResult, epas_moc: ArmResult) -> dict:
    """Mixture-of-Channels on the baseline and on EPAS (one seed): the four final validation
    losses, MoC minus the baseline and EPAS + MoC minus EPAS (and minus the baseline), each as a
    loss difference and a perplexity change; training time and tokens/s of each run, MoC's over
    the run it adds to."""
    arms = {"baseline": baseline, "moc": moc, "epas": epas, "epas_moc": epas_moc}
    result: dict = {f"{key}_final_valid_loss": arm.final_valid_loss for key, arm in arms.items()}
    for name, (variant, reference) in {"moc_minus_baseline": ("moc", "baseline"), "epas_moc_minus_epas": ("epas_moc", "epas"),
                                       "epas_moc_minus_baseline": ("epas_moc", "baseline")}.items():
        difference = arms[variant].final_valid_loss - arms[reference].final_valid_loss
        result[name] = difference
        result[name.replace("minus", "perplexity_change_vs")] = perplexity_change(difference)
    for key, arm in arms.items():
        result[f"{key}_train_time_s"] = arm.train_time_s
        result[f"{key}_tokens_per_s"] = arm.tokens_per_s
        result[f"{key}_best_tokens_per_s"] = best_interval_tokens_per_s(arm)
    for variant, reference in (("moc", "baseline"), ("epas_moc", "epas")):
        result[f"{variant}_train_time_ratio"] = _ratio(arms[variant].train_time_s, arms[reference].train_time_s)
        for kind in ("tokens_per_s", "best_tokens_per_s"):
            result[f"{variant}_{kind}_ratio"] = _ratio(result[f"{variant}_{kind}"], result[f"{reference}_{kind}"])
    return result


def moc_summary(per_seed: Sequence[dict]) -> dict:
    """:func:`moc_comparison` over seeds: the mean loss differences and their perplexity changes
    (``exp(mean difference) - 1``: the geometric mean of the perplexity ratios, minus 1) beside the
    paper's, against the baseline's seed spread; mean time and throughput ratios."""
    mean = lambda key: _mean([r[key] for r in per_seed])
    result: dict = {"seeds": [r["seed"] for r in per_seed]}
    for name in ("moc_minus_baseline", "epas_moc_minus_epas", "epas_moc_minus_baseline"):
        result[name] = [r[name] for r in per_seed]
        result[f"mean_{name}"] = mean(name)
        result[f"mean_{name.replace('minus', 'perplexity_change_vs')}"] = perplexity_change(result[f"mean_{name}"])
    for key, _ in MOC_ARMS:
        result[f"{key}_seed_spread"] = _spread([r[f"{key}_final_valid_loss"] for r in per_seed])
        result[f"mean_{key}_train_time_s"] = mean(f"{key}_train_time_s")
        result[f"mean_{key}_tokens_per_s"] = mean(f"{key}_tokens_per_s")
        result[f"mean_{key}_best_tokens_per_s"] = mean(f"{key}_best_tokens_per_s")
    spread = result["baseline_seed_spread"]
    result["baseline_seed_spread_perplexity"] = None if spread is None else perplexity_change(spread)
    for name in ("moc_minus_baseline", "epas_moc_minus_epas"):
        result[f"{name}_exceeds_baseline_spread"] = None if spread is None else abs(result[f"mean_{name}"]) > spread
    for variant in ("moc", "epas_moc"):
        result[f"mean_{variant}_train_time_ratio"] = mean(f"{variant}_train_time_ratio")
        result[f"mean_{variant}_tokens_per_s_ratio"] = mean(f"{variant}_tokens_per_s_ratio")
        result[f"mean_{variant}_best_tokens_per_s_ratio"] = mean(f"{variant}_best_tokens_per_s_ratio")
    result["paper_perplexity_change"] = dict(PAPER_MOC_PERPLEXITY_CHANGE)
    result["within_paper_cost"] = result["mean_moc_perplexity_change_vs_baseline"] <= max(PAPER_MOC_PERPLEXITY_CHANGE.values())
    return result


def _percent(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{100 * value:+.2f}%"


def moc_table(per_seed: Sequence[dict]) -> str:
    """Markdown: per seed the four final validation losses; MoC against the baseline and EPAS + MoC
    against EPAS as loss difference (perplexity change)."""
    lines = ["| seed | baseline | MoC (vs baseline: loss, perplexity) | EPAS | EPAS + MoC (vs EPAS: loss, perplexity) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['baseline_final_valid_loss']:.4f} | {r['moc_final_valid_loss']:.4f} "
              f"({r['moc_minus_baseline']:+.4f}, {_percent(r['moc_perplexity_change_vs_baseline'])}) | "
              f"{r['epas_final_valid_loss']:.4f} | {r['epas_moc_final_valid_loss']:.4f} ({r['epas_moc_minus_epas']:+.4f}, "
              f"{_percent(r['epas_moc_perplexity_change_vs_epas'])}) |" for r in per_seed]
    return "\n".join(lines)


def moc_speed_table(per_seed: Sequence[dict], summary: dict) -> str:
    """Markdown: per arm the training time of each seed and the means of training time, tokens/s
    and best-interval tokens/s; MoC's ratios over the run it adds to (MoC over the baseline, EPAS +
    MoC over EPAS)."""
    seeds = " / ".join(str(s) for s in summary["seeds"])
    lines = [f"| arm | training time (seeds {seeds}) | mean training time | mean tokens/s | mean best-interval tokens/s "
             "| time, tokens/s, best-interval tokens/s vs the run without MoC |",
             "|---|---|---|---|---|---|"]
    for key, label in MOC_ARMS:
        times = " / ".join(f"{r[f'{key}_train_time_s']:.1f} s" for r in per_seed)
        versus = ""
        if key in ("moc", "epas_moc"):
            versus = ", ".join(f"{_num(summary[f'mean_{key}_{kind}_ratio'], '.3f')}x"
                               for kind in ("train_time", "tokens_per_s", "best_tokens_per_s"))
        lines.append(f"| {label} | {times} | {_time(summary[f'mean_{key}_train_time_s'])} | "
                     f"{_num(summary[f'mean_{key}_tokens_per_s'], '.0f')} | {_num(summary[f'mean_{key}_best_tokens_per_s'], '.0f')} | "
                     + (f"{versus} |" if versus else "|"))
    return "\n".join(lines)


def moc_summary_text(summary: dict, topk: float) -> str:
    """One paragraph: what is measured, MoC's cost beside the paper's and the seed noise, and the
    timing (no speed-up expected: the GEMMs stay dense)."""
    paper = ", ".join(f"{_percent(change)} at {size}" for size, change in summary["paper_perplexity_change"].items())
    per_seed = lambda name: ", ".join(f"{d:+.4f} (seed {s})" for d, s in zip(summary[name], summary["seeds"]))
    text = (f"Measured: the final validation loss (the last evaluation of each run) of the baseline and of EPAS, each "
            f"trained again with Mixture-of-Channels (--moc-topk {topk:g}: per token the top {100 * topk:g}% of the "
            "gate channels in each group), same seed, data, tokens and learning-rate schedule; a perplexity change is "
            "exp(loss difference) - 1. MoC minus baseline: "
            f"{per_seed('moc_minus_baseline')}; mean {summary['mean_moc_minus_baseline']:+.4f}, perplexity "
            f"{_percent(summary['mean_moc_perplexity_change_vs_baseline'])}. The paper (C4 perplexity, dense to MoC at "
            f"K = 20%): {paper}; MoC's mean cost here is "
            + ("no larger than the paper's largest." if summary["within_paper_cost"] else "LARGER than the paper's largest.")
            + f" EPAS + MoC minus EPAS: {per_seed('epas_moc_minus_epas')}; mean {summary['mean_epas_moc_minus_epas']:+.4f}, "
            f"perplexity {_percent(summary['mean_epas_moc_perplexity_change_vs_epas'])} (EPAS + MoC minus the baseline: mean "
            f"{summary['mean_epas_moc_minus_baseline']:+.4f}, {_percent(summary['mean_epas_moc_perplexity_change_vs_baseline'])}).")
    spread = summary["baseline_seed_spread"]
    if spread is None:
        text += " One seed: no spread to compare with."
    else:
        verdict = lambda name: "larger than" if summary[f"{name}_exceeds_baseline_spread"] else "within"
        text += (f" The baseline's seed spread of the final loss is {spread:.4f} (perplexity "
                 f"{_percent(summary['baseline_seed_spread_perplexity'])}; EPAS {summary['epas_seed_spread']:.4f}): MoC's "
                 f"mean difference is {verdict('moc_minus_baseline')} it, EPAS + MoC's against EPAS "
                 f"{verdict('epas_moc_minus_epas')} it.")
    text += (" Timing (training steps only, from the same runs): MoC over the baseline "
             f"{_num(summary['mean_moc_train_time_ratio'], '.3f')}x "
             f"the training time and {_num(summary['mean_moc_tokens_per_s_ratio'], '.3f')}x the tokens/s "
             f"({_num(summary['mean_moc_best_tokens_per_s_ratio'], '.3f')}x in the best logging interval), EPAS + MoC over EPAS "
             f"{_num(summary['mean_epas_moc_train_time_ratio'], '.3f')}x, {_num(summary['mean_epas_moc_tokens_per_s_ratio'], '.3f')}x "
             f"({_num(summary['mean_epas_moc_best_tokens_per_s_ratio'], '.3f')}x). "
             "MoC's GEMMs stay dense (as in the paper), and the Top-K selection and the scatter come on top, so no speed-up "
             "is expected; what MoC saves is the activation memory kept for backward, which this recipe does not measure.")
    return text
