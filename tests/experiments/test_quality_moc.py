"""epas-bench quality --parts moc: the arms its dry run plans (names, flags, the baseline and EPAS
arms it shares) and every number of its report recomputed by hand from planted run files
(metrics.jsonl records and summaries the recipe reads back as finished arms, so no model runs)."""

import json
import math

import pytest

from epas_megatron.bench.cli import main
from epas_megatron.config.cli import parse_config
from epas_megatron.experiments import quality_report as report
from epas_megatron.experiments.quality import QualityRecipe
from epas_megatron.experiments.quality_plan import DEFAULT_PARTS, SCALES, plan_arms
from epas_megatron.validation import resolve_run

SEEDS = (1234, 1235, 1236)
SUFFIXES = ("", "_seed1235", "_seed1236")
KINDS = ("baseline", "epas", "moc", "epas_moc")


def dry_run(capsys, *argv) -> dict[str, str]:
    assert main(["quality", "--dry-run", "--output-dir", "/tmp/q", *argv]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ": " in line]
    return {name: command.split(" --output-dir ")[0] for name, command in (line.split(": ", 1) for line in lines)}


def test_dry_run_of_the_moc_part(capsys):
    commands = dry_run(capsys, "--parts", "moc", "--seeds", ",".join(map(str, SEEDS)))
    # Per seed: the baseline and EPAS arms it compares against, then MoC on each.
    assert list(commands) == [f"scratch_{kind}{suffix}" for suffix in SUFFIXES for kind in KINDS]
    for seed, suffix in zip(SEEDS, SUFFIXES):
        baseline, epas = commands[f"scratch_baseline{suffix}"], commands[f"scratch_epas{suffix}"]
        assert f"--seed {seed} " in baseline and baseline.endswith("--epas-target-layers 0")
        assert f"--seed {seed} " in epas and epas.endswith("--epas-target-layers 0.5 --epas-interval 50 --eval-regions 0,half,max")
        # MoC: the baseline's flags and the (plain) EPAS run's flags, each with the paper's K = 20%.
        assert commands[f"scratch_moc{suffix}"] == f"{baseline} --moc-topk 0.2"
        plain = epas.replace(" --eval-regions 0,half,max", "")
        assert commands[f"scratch_epas_moc{suffix}"] == f"{plain} --moc-topk 0.2"
    assert "moc" not in DEFAULT_PARTS and not any("moc" in name for name in dry_run(capsys))


def test_the_moc_arms_share_the_baseline_and_epas_arms(capsys):
    alone = dry_run(capsys, "--parts", "moc")
    # With the from-scratch part and another ablation the shared arms are planned once, with the same flags.
    both = dry_run(capsys, "--parts", "scratch,fixed,moc")
    # (the from-scratch part plans every seed's baseline and EPAS first)
    assert list(both) == [f"scratch_{kind}{suffix}" for suffix in ("", "_seed4321") for kind in ("baseline", "epas")] + \
        [f"scratch_{kind}{suffix}" for suffix in ("", "_seed4321") for kind in ("fixed", "moc", "epas_moc")]
    assert all(both[name] == command for name, command in alone.items())
    assert "--moc-topk" not in both["scratch_fixed"] and "--moc-topk" not in both["scratch_epas"]


def test_the_planned_moc_arms_pass_the_trainers_checks(tmp_path):
    for arm in plan_arms(SCALES["cpu"], tmp_path, parts=("moc",)):
        cfg = parse_config([*arm.train_args, "--output-dir", str(tmp_path / arm.name)])
        resolve_run(cfg, world_size=1, cuda=False)
        # The small preset's 1024 SwiGLU channels in the default 8 groups (128 each).
        assert (cfg.model.moc_topk, cfg.model.moc_groups) == ((0.2, 8) if "moc" in arm.name else (1.0, 8))


# Planted runs: evaluations at iterations 25, 50, 75, 100; the last one is the final loss.
FINAL = {  # seed -> final validation loss of baseline, MoC, EPAS, EPAS + MoC
    1234: {"baseline": 4.20, "moc": 4.28, "epas": 4.30, "epas_moc": 4.33},
    1235: {"baseline": 4.26, "moc": 4.33, "epas": 4.32, "epas_moc": 4.38},
    1236: {"baseline": 4.23, "moc": 4.32, "epas": 4.34, "epas_moc": 4.35},
}
TIME = {  # seed -> training time (s), tokens/s
    1234: {"baseline": (100.0, 800.0), "moc": (120.0, 640.0), "epas": (90.0, 900.0), "epas_moc": (99.0, 810.0)},
    1235: {"baseline": (110.0, 720.0), "moc": (121.0, 648.0), "epas": (99.0, 800.0), "epas_moc": (99.0, 800.0)},
    1236: {"baseline": (105.0, 760.0), "moc": (126.0, 608.0), "epas": (84.0, 950.0), "epas_moc": (105.0, 760.0)},
}

BEST = {  # seed -> the fastest logging interval's tokens/s (the other interval runs at half of it)
    1234: {"baseline": 1000.0, "moc": 900.0, "epas": 1200.0, "epas_moc": 1080.0},
    1235: {"baseline": 1100.0, "moc": 990.0, "epas": 1300.0, "epas_moc": 1300.0},
    1236: {"baseline": 1050.0, "moc": 840.0, "epas": 1250.0, "epas_moc": 1000.0},
}


def write_arm(out, name, final, seconds, tokens_per_s, best):
    run = out / name / "run"
    run.mkdir(parents=True)
    losses = [5.0, 4.7, 4.5, final]
    records = [{"iteration": 50, "iteration_time_s": 1.0, "tokens_per_s": best / 2},
               {"iteration": 100, "iteration_time_s": 0.5, "tokens_per_s": best}]
    records += [{"kind": "valid", "iteration": i, "region": 0, "in_training": True, "lm_loss": loss, "train_time_s": seconds * (n + 1) / 4}
               for n, (i, loss) in enumerate(zip((25, 50, 75, 100), losses))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"train_time_s": seconds, "tokens_per_s": tokens_per_s, "final_valid_lm_loss": final, "exit_reason": "completed"}
    (out / name / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def numbers(tmp_path):
    out = tmp_path / "quality"
    for seed, suffix in zip(SEEDS, SUFFIXES):
        for kind in KINDS:
            write_arm(out, f"scratch_{kind}{suffix}", FINAL[seed][kind], *TIME[seed][kind], BEST[seed][kind])
    lines = []
    result = QualityRecipe("cpu", out, parts=("moc",), seeds=SEEDS, echo=lines.append).run()
    assert sum("finished before; reusing" in line for line in lines) == 12  # nothing trained
    assert json.loads((out / "quality.json").read_text())["moc_summary"] == result["moc_summary"]
    assert (out / "moc_loss_vs_tokens.png").is_file() and (out / "moc_loss_vs_time.png").is_file()
    result["markdown"] = (out / "quality.md").read_text()
    return result


def ppl_change(variant: float, reference: float) -> float:
    """Perplexity ratio minus 1, from the two perplexities themselves."""
    return math.exp(variant) / math.exp(reference) - 1


def test_moc_report_per_seed_by_hand(numbers):
    rows = numbers["moc"]
    assert [r["seed"] for r in rows] == list(SEEDS)
    # MoC minus baseline 0.08, 0.07, 0.09; EPAS + MoC minus EPAS 0.03, 0.06, 0.01; EPAS + MoC minus baseline 0.13, 0.12, 0.12.
    for r, moc, epas_moc, vs_base in zip(rows, (0.08, 0.07, 0.09), (0.03, 0.06, 0.01), (0.13, 0.12, 0.12)):
        loss = FINAL[r["seed"]]
        assert [r[f"{kind}_final_valid_loss"] for kind in ("baseline", "moc", "epas", "epas_moc")] == \
            [loss["baseline"], loss["moc"], loss["epas"], loss["epas_moc"]]
        assert r["moc_minus_baseline"] == pytest.approx(moc) and r["epas_moc_minus_epas"] == pytest.approx(epas_moc)
        assert r["epas_moc_minus_baseline"] == pytest.approx(vs_base)
        assert r["moc_perplexity_change_vs_baseline"] == pytest.approx(ppl_change(loss["moc"], loss["baseline"]))
        assert r["epas_moc_perplexity_change_vs_epas"] == pytest.approx(ppl_change(loss["epas_moc"], loss["epas"]))
        assert r["epas_moc_perplexity_change_vs_baseline"] == pytest.approx(ppl_change(loss["epas_moc"], loss["baseline"]))
    # Seed 1234's times: MoC 120 s over 100 s, 640 over 800 tokens/s; EPAS + MoC 99 s over 90 s, 810 over 900 tokens/s.
    first = rows[0]
    assert first["moc_train_time_ratio"] == pytest.approx(1.2) and first["moc_tokens_per_s_ratio"] == pytest.approx(0.8)
    assert first["epas_moc_train_time_ratio"] == pytest.approx(1.1) and first["epas_moc_tokens_per_s_ratio"] == pytest.approx(0.9)
    assert first["epas_train_time_s"] == 90.0 and first["epas_tokens_per_s"] == 900.0
    # Best intervals: MoC 900 over 1000, EPAS + MoC 1080 over 1200.
    assert first["moc_best_tokens_per_s"] == 900.0 and first["moc_best_tokens_per_s_ratio"] == pytest.approx(0.9)
    assert first["epas_moc_best_tokens_per_s_ratio"] == pytest.approx(0.9)
    # exp(0.08) - 1 = 8.33%, exp(0.03) - 1 = 3.05%; exp(0.07) - 1 = 7.25%, exp(0.06) - 1 = 6.18%.
    markdown = numbers["markdown"]
    assert "### Mixture-of-Channels (--moc-topk 0.2) on the baseline and on EPAS" in markdown
    assert "| seed | baseline | MoC (vs baseline: loss, perplexity) | EPAS | EPAS + MoC (vs EPAS: loss, perplexity) |" in markdown
    assert "| 1234 | 4.2000 | 4.2800 (+0.0800, +8.33%) | 4.3000 | 4.3300 (+0.0300, +3.05%) |" in markdown
    assert "| 1235 | 4.2600 | 4.3300 (+0.0700, +7.25%) | 4.3200 | 4.3800 (+0.0600, +6.18%) |" in markdown


def test_moc_report_over_seeds_by_hand(numbers):
    summary = numbers["moc_summary"]
    assert summary["topk"] == 0.2 and summary["seeds"] == list(SEEDS)
    assert summary["mean_moc_minus_baseline"] == pytest.approx(0.08)
    assert summary["mean_epas_moc_minus_epas"] == pytest.approx(0.1 / 3)
    assert summary["mean_epas_moc_minus_baseline"] == pytest.approx(0.37 / 3)
    # Over seeds: the geometric mean of the perplexity ratios, minus 1.
    geometric = lambda kind, reference: math.prod(math.exp(FINAL[s][kind]) / math.exp(FINAL[s][reference]) for s in SEEDS) ** (1 / 3) - 1
    assert summary["mean_moc_perplexity_change_vs_baseline"] == pytest.approx(geometric("moc", "baseline"))
    assert summary["mean_epas_moc_perplexity_change_vs_epas"] == pytest.approx(geometric("epas_moc", "epas"))
    # Spreads: baseline 4.26 - 4.20, MoC 4.33 - 4.28, EPAS 4.34 - 4.30, EPAS + MoC 4.38 - 4.33.
    assert summary["baseline_seed_spread"] == pytest.approx(0.06) and summary["moc_seed_spread"] == pytest.approx(0.05)
    assert summary["epas_seed_spread"] == pytest.approx(0.04) and summary["epas_moc_seed_spread"] == pytest.approx(0.05)
    assert summary["baseline_seed_spread_perplexity"] == pytest.approx(math.exp(4.26) / math.exp(4.20) - 1)
    assert summary["moc_minus_baseline_exceeds_baseline_spread"] is True  # 0.08 > 0.06
    assert summary["epas_moc_minus_epas_exceeds_baseline_spread"] is False  # 0.033 < 0.06
    # The paper's C4 perplexities: 28.71 -> 29.11 (60M), 21.47 -> 21.76 (130M), 16.02 -> 16.18 (350M).
    assert summary["paper_perplexity_change"] == {"60M": pytest.approx(0.40 / 28.71), "130M": pytest.approx(0.29 / 21.47),
                                                  "350M": pytest.approx(0.16 / 16.02)}
    assert summary["within_paper_cost"] is False  # 8.3% against at most 1.4%
    # Time and throughput ratios, mean over seeds: MoC (1.2, 1.1, 1.2) and (0.8, 0.9, 0.8); EPAS + MoC
    # (1.1, 1.0, 1.25) and (0.9, 1.0, 0.8).
    assert summary["mean_moc_train_time_ratio"] == pytest.approx(3.5 / 3)
    assert summary["mean_moc_tokens_per_s_ratio"] == pytest.approx(2.5 / 3)
    assert summary["mean_epas_moc_train_time_ratio"] == pytest.approx(3.35 / 3)
    assert summary["mean_epas_moc_tokens_per_s_ratio"] == pytest.approx(0.9)
    # Best intervals: MoC (0.9, 0.9, 0.8), EPAS + MoC (0.9, 1.0, 0.8); means 1050, 910, 1250, 3380 / 3.
    assert summary["mean_moc_best_tokens_per_s_ratio"] == pytest.approx(2.6 / 3)
    assert summary["mean_epas_moc_best_tokens_per_s_ratio"] == pytest.approx(0.9)
    assert summary["mean_baseline_best_tokens_per_s"] == pytest.approx(1050) and summary["mean_moc_best_tokens_per_s"] == pytest.approx(910)
    assert summary["mean_baseline_train_time_s"] == pytest.approx(105.0) and summary["mean_epas_tokens_per_s"] == pytest.approx(2650 / 3)
    markdown = numbers["markdown"]
    assert "| arm | training time (seeds 1234 / 1235 / 1236) | mean training time | mean tokens/s | mean best-interval" in markdown
    assert "| baseline | 100.0 s / 110.0 s / 105.0 s | 105.0 s | 760 | 1050 | |" in markdown
    assert "| MoC | 120.0 s / 121.0 s / 126.0 s | 122.3 s | 632 | 910 | 1.167x, 0.833x, 0.867x |" in markdown
    assert "| EPAS + MoC | 99.0 s / 99.0 s / 105.0 s | 101.0 s | 790 | 1127 | 1.117x, 0.900x, 0.900x |" in markdown
    # exp(0.08) - 1 = 8.33%; exp(0.0333) - 1 = 3.39%; exp(0.1233) - 1 = 13.13%; exp(0.06) - 1 = 6.18%.
    assert ("MoC minus baseline: +0.0800 (seed 1234), +0.0700 (seed 1235), +0.0900 (seed 1236); mean +0.0800, perplexity "
            "+8.33%. The paper (C4 perplexity, dense to MoC at K = 20%): +1.39% at 60M, +1.35% at 130M, +1.00% at 350M; "
            "MoC's mean cost here is LARGER than the paper's largest.") in markdown
    assert ("EPAS + MoC minus EPAS: +0.0300 (seed 1234), +0.0600 (seed 1235), +0.0100 (seed 1236); mean +0.0333, "
            "perplexity +3.39%") in markdown
    assert "(EPAS + MoC minus the baseline: mean +0.1233, +13.13%)" in markdown
    assert ("The baseline's seed spread of the final loss is 0.0600 (perplexity +6.18%; EPAS 0.0400): MoC's mean difference "
            "is larger than it, EPAS + MoC's against EPAS within it.") in markdown
    assert ("MoC over the baseline 1.167x the training time and 0.833x the tokens/s (0.867x in the best logging interval), "
            "EPAS + MoC over EPAS 1.117x, 0.900x (0.900x)") in markdown
    assert "no speed-up is expected" in markdown and "`moc_loss_vs_tokens.png`, `moc_loss_vs_time.png`" in markdown


def test_one_seed_within_the_papers_cost():
    arm = lambda name, loss: report.ArmResult(name, {"train_time_s": 10.0, "tokens_per_s": None},
                                              [{"kind": "valid", "iteration": 1, "lm_loss": loss}])
    row = {"seed": 7, **report.moc_comparison(arm("b", 3.0), arm("m", 3.01), arm("e", 3.1), arm("em", 3.1))}
    summary = report.moc_summary([row])
    # exp(0.01) - 1 = 1.005%, below the paper's largest 0.40 / 28.71 = 1.393%.
    assert summary["mean_moc_perplexity_change_vs_baseline"] == pytest.approx(math.exp(3.01) / math.exp(3.0) - 1)
    assert summary["within_paper_cost"] is True and summary["baseline_seed_spread"] is None
    assert summary["moc_minus_baseline_exceeds_baseline_spread"] is None and summary["mean_moc_tokens_per_s_ratio"] is None
    text = report.moc_summary_text(summary, 0.2)
    assert "mean +0.0100, perplexity +1.01%" in text and "no larger than the paper's largest" in text
    assert "One seed: no spread to compare with." in text and "0.2: per token the top 20% of the gate channels" in text
