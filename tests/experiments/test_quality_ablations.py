"""epas-bench quality --parts fixed,rewarm,blocks,ramp: the commands its dry run prints, and every number of its
report recomputed by hand from synthetic run files (metrics.jsonl records and summaries the recipe
reads back as finished arms, so no model runs)."""

import json
from dataclasses import replace

import pytest

from epas_megatron.bench.cli import main
from epas_megatron.config.cli import parse_config
from epas_megatron.experiments import quality_report as report
from epas_megatron.experiments.quality import QualityRecipe
from epas_megatron.experiments.quality_plan import DEFAULT_PARTS, SCALES, plan_arms
from epas_megatron.validation import resolve_run


def dry_run(capsys, *argv) -> dict[str, str]:
    assert main(["quality", "--dry-run", "--output-dir", "/tmp/q", *argv]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ": " in line]
    return {name: command for name, command in (line.split(": ", 1) for line in lines)}


def test_dry_run_of_the_fixed_and_rewarm_parts(capsys):
    commands = dry_run(capsys, "--parts", "fixed,rewarm")
    assert list(commands) == [f"scratch_{kind}{suffix}" for suffix in ("", "_seed4321")
                              for kind in ("baseline", "epas", "fixed", "rewarm")]
    for suffix, seed in (("", 1234), ("_seed4321", 4321)):
        epas = commands[f"scratch_epas{suffix}"].split(" --output-dir ")[0]
        assert f"--seed {seed} " in epas and "--epas-target-layers 0.5 --epas-interval 50" in epas
        plain = epas.replace(" --eval-regions 0,half,max", "")
        # Fixed: the same run with the whole region (4 of the small preset's 8 layers) switched before step 1.
        assert commands[f"scratch_fixed{suffix}"] == (f"{plain} --epas-first-switch 1 --epas-growth 4 "
                                                      f"--output-dir /tmp/q/scratch_fixed{suffix}/run")
        # Re-warm: the same run with a quarter of the interval re-warmed after each switch.
        assert commands[f"scratch_rewarm{suffix}"] == f"{plain} --epas-switch-rewarm 12 --output-dir /tmp/q/scratch_rewarm{suffix}/run"
    # Neither is in the default set; with the from-scratch part the shared arms run once.
    assert not {"fixed", "rewarm"} & set(DEFAULT_PARTS)
    assert not any("fixed" in name or "rewarm" in name for name in dry_run(capsys))
    both = dry_run(capsys, "--parts", "scratch,fixed,rewarm")
    assert sorted(both) == sorted(commands)
    # The smoke scale's interval of 2 re-warms 1 iteration (a quarter, at least 1).
    assert "--epas-switch-rewarm 1 " in dry_run(capsys, "--scale", "smoke", "--parts", "rewarm")["scratch_rewarm"]


def test_dry_run_of_the_blocks_part(capsys):
    commands = dry_run(capsys, "--parts", "blocks")
    assert list(commands) == [f"scratch_{kind}{suffix}" for suffix in ("", "_seed4321") for kind in ("baseline", "epas", "blocks")]
    for suffix in ("", "_seed4321"):
        plain = commands[f"scratch_epas{suffix}"].split(" --output-dir ")[0].replace(" --eval-regions 0,half,max", "")
        # the same target (4 of 8 layers), interval and growth, in two blocks
        assert commands[f"scratch_blocks{suffix}"] == f"{plain} --epas-blocks 2 --output-dir /tmp/q/scratch_blocks{suffix}/run"
    assert "blocks" not in DEFAULT_PARTS


def test_dry_run_of_the_ramp_part(capsys):
    # --parts ramp alone plans the baseline and EPAS arms it is compared against.
    commands = dry_run(capsys, "--parts", "ramp")
    assert list(commands) == [f"scratch_{kind}{suffix}" for suffix in ("", "_seed4321") for kind in ("baseline", "epas", "ramp")]
    for suffix, seed in (("", 1234), ("_seed4321", 4321)):
        assert f"--seed {seed} " in commands[f"scratch_baseline{suffix}"]
        assert "--epas-target-layers 0 " in commands[f"scratch_baseline{suffix}"]
        plain = commands[f"scratch_epas{suffix}"].split(" --output-dir ")[0].replace(" --eval-regions 0,half,max", "")
        assert f"--seed {seed} " in plain and "--epas-target-layers 0.5 --epas-interval 50" in plain
        # The same run blending over a quarter of the interval (50 // 4 = 12) before each switch.
        assert commands[f"scratch_ramp{suffix}"] == f"{plain} --epas-switch-ramp 12 --output-dir /tmp/q/scratch_ramp{suffix}/run"
    assert "ramp" not in DEFAULT_PARTS and not any("ramp" in name for name in dry_run(capsys))
    # With the re-warm the shared arms are planned once; each remedy changes one flag only.
    both = dry_run(capsys, "--parts", "rewarm,ramp")
    assert list(both) == [f"scratch_{kind}{suffix}" for suffix in ("", "_seed4321") for kind in ("baseline", "epas", "rewarm", "ramp")]
    assert "--epas-switch-ramp" not in both["scratch_rewarm"] and "--epas-switch-rewarm" not in both["scratch_ramp"]
    # The smoke scale's interval of 2 blends 1 iteration (a quarter, at least 1).
    assert "--epas-switch-ramp 1 " in dry_run(capsys, "--scale", "smoke", "--parts", "ramp")["scratch_ramp"]


def test_the_remedies_length_is_a_recipe_flag(capsys):
    commands = dry_run(capsys, "--parts", "rewarm,ramp", "--switch-ramp", "36")
    plain = commands["scratch_epas"].split(" --output-dir ")[0].replace(" --eval-regions 0,half,max", "")
    assert commands["scratch_ramp"] == f"{plain} --epas-switch-ramp 36 --output-dir /tmp/q/scratch_ramp/run"
    assert commands["scratch_rewarm"] == f"{plain} --epas-switch-rewarm 12 --output-dir /tmp/q/scratch_rewarm/run"
    assert "--epas-switch-rewarm 49 " in dry_run(capsys, "--parts", "rewarm", "--switch-rewarm", "49")["scratch_rewarm"]


@pytest.mark.parametrize("scale, steps, longest", [("cpu", 12, 49), ("smoke", 1, 1)])
def test_the_planned_ramp_arms_pass_the_trainers_checks(tmp_path, scale, steps, longest):
    # N must be < --epas-interval and < --epas-first-switch (the interval here); the trainer says so,
    # also for the longest ramp --switch-ramp accepts.
    arms = plan_arms(replace(SCALES[scale], ramp_steps=longest), tmp_path, parts=("ramp",))
    for arm in arms:
        if arm.name.startswith("scratch_ramp"):
            cfg = parse_config([*arm.train_args, "--output-dir", str(tmp_path / arm.name)])
            resolve_run(cfg, world_size=1, cuda=False)
            assert cfg.epas.epas_switch_ramp == longest
    for arm in plan_arms(SCALES[scale], tmp_path, parts=("ramp",)):
        if arm.name.startswith("scratch_ramp"):
            cfg = parse_config([*arm.train_args, "--output-dir", str(tmp_path / arm.name)])
            assert cfg.epas.epas_switch_ramp == steps
            resolve_run(cfg, world_size=1, cuda=False)


def test_an_unknown_part_names_the_new_ones(capsys):
    assert main(["quality", "--dry-run", "--parts", "scratch,speed"]) == 2
    assert "choose among scratch, continual, ablation, random_ltd, fixed, rewarm, blocks, ramp, moc" in capsys.readouterr().err


def test_the_parts_help_lists_ramp(capsys):
    with pytest.raises(SystemExit):
        main(["quality", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "experiments to run (comma-separated): scratch, continual, ablation, random_ltd, fixed, rewarm, blocks, ramp, moc" in help_text


# Synthetic runs: evaluations at iterations 25, 50, 75, 100 (training seconds 10/20/30/40 for the
# baseline, 9/18/27/36 for the EPAS arms), switches at 50 and 100 (the fixed arm's at 1).
ITERATIONS = (25, 50, 75, 100)
SEED_1234 = {
    "scratch_baseline": ([5.0, 4.6, 4.4, 4.2], 10.0, []),
    "scratch_epas": ([5.0, 4.8, 4.45, 4.35], 9.0, [50, 100]),
    "scratch_fixed": ([5.1, 4.9, 4.6, 4.5], 9.0, [1]),
    "scratch_rewarm": ([5.0, 4.7, 4.4, 4.15], 9.0, [50, 100]),
    "scratch_blocks": ([5.0, 4.85, 4.5, 4.4], 9.0, [50, 100]),
    "scratch_ramp": ([5.0, 4.65, 4.42, 4.34], 9.0, [50, 100]),
}
# Seed 4321: every loss of an arm shifted by a constant.
SHIFT_4321 = {"scratch_baseline": 0.05, "scratch_epas": 0.02, "scratch_fixed": -0.2, "scratch_rewarm": 0.10, "scratch_blocks": 0.0,
              "scratch_ramp": -0.10}


def write_arm(out, name, losses, seconds_per_eval, switches):
    run = out / name / "run"
    run.mkdir(parents=True)
    records = [{"kind": "switch", "iteration": t} for t in switches]
    records += [{"kind": "valid", "iteration": i, "region": 0, "in_training": True, "lm_loss": loss,
                 "train_time_s": seconds_per_eval * (n + 1)} for n, (i, loss) in enumerate(zip(ITERATIONS, losses))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"train_time_s": seconds_per_eval * len(ITERATIONS), "final_valid_lm_loss": losses[-1], "exit_reason": "completed"}
    (out / name / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def numbers(tmp_path):
    out = tmp_path / "quality"
    for name, (losses, seconds, switches) in SEED_1234.items():
        write_arm(out, name, losses, seconds, switches)
        write_arm(out, f"{name}_seed4321", [loss + SHIFT_4321[name] for loss in losses], seconds, switches)
    lines = []
    result = QualityRecipe("cpu", out, parts=("fixed", "rewarm", "blocks", "ramp"), echo=lines.append).run()
    assert sum("finished before; reusing" in line for line in lines) == 12  # nothing trained
    written = json.loads((out / "quality.json").read_text())
    assert written["rewarm_summary"] == result["rewarm_summary"] and written["fixed_summary"] == result["fixed_summary"]
    assert written["ramp_summary"] == result["ramp_summary"]
    result["markdown"] = (out / "quality.md").read_text()
    return result


def test_fixed_report_by_hand(numbers):
    first, second = numbers["fixed"]
    assert (first["seed"], second["seed"]) == (1234, 4321)
    assert first["fixed_minus_progressive"] == pytest.approx(4.5 - 4.35)  # 0.15
    assert second["fixed_minus_progressive"] == pytest.approx(4.30 - 4.37)  # -0.07
    assert first["fixed_gap"] == pytest.approx(0.3) and second["progressive_gap"] == pytest.approx(4.37 - 4.25)
    summary = numbers["fixed_summary"]
    assert summary["mean_fixed_minus_progressive"] == pytest.approx(0.04) and summary["agrees_with_paper"]
    assert summary["baseline_seed_spread"] == pytest.approx(0.05) and summary["progressive_seed_spread"] == pytest.approx(0.02)
    assert summary["fixed_seed_spread"] == pytest.approx(0.2) and summary["exceeds_seed_spread"] is False
    assert "| 1234 | 4.2000 | 4.3500 (+0.1500) | 4.5000 (+0.3000) | +0.1500 |" in numbers["markdown"]
    assert "mean +0.0400. The paper's claim: progressive growth of the region is what keeps" in numbers["markdown"]
    assert "the mean difference is within the seed noise" in numbers["markdown"]


def test_blocks_report_by_hand(numbers):
    first, second = numbers["blocks"]
    assert first["blocks_minus_one_block"] == pytest.approx(4.40 - 4.35)  # 0.05
    assert second["blocks_minus_one_block"] == pytest.approx(4.40 - 4.37)  # 0.03
    assert first["blocks_gap"] == pytest.approx(0.2) and second["one_block_gap"] == pytest.approx(4.37 - 4.25)
    summary = numbers["blocks_summary"]
    assert summary["mean_blocks_minus_one_block"] == pytest.approx(0.04) and summary["agrees_with_paper"]
    assert summary["blocks_seed_spread"] == pytest.approx(0.0) and summary["exceeds_seed_spread"] is False
    markdown = numbers["markdown"]
    assert "### One sharing block vs 2 (--epas-blocks 2, 4 sharing layers in all)" in markdown
    assert "| seed | baseline | EPAS, one block (gap) | EPAS, 2 blocks (gap) | blocks - one block |" in markdown
    assert "| 1234 | 4.2000 | 4.3500 (+0.1500) | 4.4000 (+0.2000) | +0.0500 |" in markdown
    assert "Blocks minus one block final validation loss: +0.0500 (seed 1234), +0.0300 (seed 4321); mean +0.0400" in markdown
    assert "one contiguous sharing block beats several smaller ones" in markdown and "one block is better (agrees)" in markdown


def test_rewarm_report_by_hand(numbers):
    first, second = numbers["rewarm"]
    assert first["epas_gap"] == pytest.approx(0.15) and first["rewarm_gap"] == pytest.approx(-0.05)
    assert second["epas_gap"] == pytest.approx(0.12) and second["rewarm_gap"] == pytest.approx(0.0, abs=1e-12)
    # Jumps: after (first evaluation at >= t) minus before (last at < t); against the baseline, minus
    # the baseline's change between the same evaluations (-0.4 from 25 to 50, -0.2 from 75 to 100).
    expected_epas = [(50, 25, 50, -0.2, 0.2), (100, 75, 100, -0.1, 0.1)]
    expected_rewarm = [(50, 25, 50, -0.3, 0.1), (100, 75, 100, -0.25, -0.05)]
    for result in (first, second):
        for key, expected in (("epas_jumps", expected_epas), ("rewarm_jumps", expected_rewarm)):
            got = [(r["iteration"], r["before_iteration"], r["after_iteration"], r["jump"], r["jump_vs_baseline"])
                   for r in result[key]]
            assert got == [(t, b, a, pytest.approx(j), pytest.approx(v)) for t, b, a, j, v in expected]
        assert result["epas_max_jump"] == pytest.approx(-0.1) and result["rewarm_max_jump"] == pytest.approx(-0.25)
        assert result["epas_mean_jump_vs_baseline"] == pytest.approx(0.15)
        assert result["rewarm_mean_jump_vs_baseline"] == pytest.approx(0.025)
    # Time to the baseline's final loss: seed 1234's re-warm crosses 4.2 between 4.4 at 27 s and 4.15
    # at 36 s (27 + 9 x 0.2 / 0.25); seed 4321's reaches 4.25 exactly at its last evaluation.
    assert first["rewarm_time_to_target_s"] == pytest.approx(34.2) and second["rewarm_time_to_target_s"] == pytest.approx(36.0)
    assert first["epas_time_to_target_s"] is None and first["baseline_time_to_target_s"] == 40.0
    summary = numbers["rewarm_summary"]
    assert summary["steps"] == 12
    assert summary["mean_epas_gap"] == pytest.approx(0.135) and summary["mean_rewarm_gap"] == pytest.approx(-0.025)
    assert summary["mean_rewarm_minus_epas"] == pytest.approx(-0.16)
    assert summary["baseline_seed_spread"] == pytest.approx(0.05) and summary["rewarm_gap_within_seed_spread"]
    assert summary["rewarm_reaches_target"] == [True, True]
    markdown = numbers["markdown"]
    assert "| EPAS + LR re-warm | 4.1500 | -0.0500 | 34.2 s | 50: -0.3000 (+0.1000), 100: -0.2500 (-0.0500) |" in markdown
    assert "| EPAS | 4.3500 | +0.1500 | not reached | 50: -0.2000 (+0.2000), 100: -0.1000 (+0.1000) |" in markdown
    assert "mean -0.0250 against plain EPAS's +0.1350" in markdown and "within the baseline's seed spread (0.0500)" in markdown


def test_ramp_report_by_hand(numbers):
    first, second = numbers["ramp"]
    assert (first["seed"], second["seed"]) == (1234, 4321)
    # Seed 1234: baseline 4.20, EPAS 4.35, ramp 4.34; seed 4321: 4.25, 4.37, 4.24.
    assert first["ramp_final_valid_loss"] == pytest.approx(4.34) and second["ramp_final_valid_loss"] == pytest.approx(4.24)
    assert first["ramp_gap"] == pytest.approx(0.14) and second["ramp_gap"] == pytest.approx(-0.01)
    assert first["ramp_minus_epas"] == pytest.approx(-0.01) and second["ramp_minus_epas"] == pytest.approx(-0.13)
    assert first["epas_gap"] == pytest.approx(0.15) and second["epas_gap"] == pytest.approx(0.12)
    # Jumps: 4.65 - 5.0 = -0.35 at 50 (the baseline's -0.4 subtracted: +0.05); 4.34 - 4.42 = -0.08 at
    # 100 (the baseline's -0.2 subtracted: +0.12). Shifting a whole arm changes neither.
    expected = [(50, 25, 50, -0.35, 0.05), (100, 75, 100, -0.08, 0.12)]
    for result in (first, second):
        got = [(r["iteration"], r["before_iteration"], r["after_iteration"], r["jump"], r["jump_vs_baseline"])
               for r in result["ramp_jumps"]]
        assert got == [(t, b, a, pytest.approx(j), pytest.approx(v)) for t, b, a, j, v in expected]
        assert result["ramp_max_jump"] == pytest.approx(-0.08) and result["ramp_mean_jump_vs_baseline"] == pytest.approx(0.085)
        assert result["epas_max_jump"] == pytest.approx(-0.1) and result["epas_mean_jump_vs_baseline"] == pytest.approx(0.15)
    # Time to the baseline's final loss: seed 1234's ramp never reaches 4.20; seed 4321's crosses 4.25
    # between 4.32 at 27 s and 4.24 at 36 s (27 + 9 x 0.07 / 0.08).
    assert first["ramp_time_to_target_s"] is None and second["ramp_time_to_target_s"] == pytest.approx(34.875)
    assert first["ramp_train_time_s"] == 36.0 and first["baseline_time_to_target_s"] == 40.0
    summary = numbers["ramp_summary"]
    assert summary["steps"] == 12 and summary["seeds"] == [1234, 4321]
    assert summary["ramp_gaps"] == [pytest.approx(0.14), pytest.approx(-0.01)]
    assert summary["mean_ramp_gap"] == pytest.approx(0.065) and summary["mean_epas_gap"] == pytest.approx(0.135)
    assert summary["mean_ramp_minus_epas"] == pytest.approx(-0.07)
    # 0.065 exceeds the baseline's spread of 4.25 - 4.20.
    assert summary["baseline_seed_spread"] == pytest.approx(0.05) and summary["ramp_gap_within_seed_spread"] is False
    assert summary["mean_ramp_max_jump"] == pytest.approx(-0.08) and summary["mean_ramp_jump_vs_baseline"] == pytest.approx(0.085)
    assert summary["ramp_reaches_target"] == [False, True]
    markdown = numbers["markdown"]
    assert "### Blended switch, Q/K ramped onto the source's before each switch (--epas-switch-ramp 12), seed 1234" in markdown
    assert "| EPAS + blended switch | 4.3400 | +0.1400 | not reached | 50: -0.3500 (+0.0500), 100: -0.0800 (+0.1200) |" in markdown
    assert "| EPAS + blended switch | 4.2400 | -0.0100 | 34.9 s |" in markdown
    assert ("EPAS with --epas-switch-ramp 12 (two multiply-adds per blended Q/K element; a remedy beyond the paper, "
            "which makes no claim about it): gap to the baseline +0.1400 (seed 1234), -0.0100 (seed 4321); mean +0.0650 "
            "against plain EPAS's +0.1350 (ramp minus plain -0.0700). Largest jump after a switch, mean over seeds: "
            "-0.0800 with the ramp, -0.1000 without; against the baseline +0.0850 vs +0.1500") in markdown
    assert "The ramp's mean gap is outside the baseline's seed spread (0.0500)" in markdown
    assert "It reaches the baseline's final loss in 1 of 2 seed(s)." in markdown
    # The re-warm's paragraph says the same of it.
    assert "EPAS with --epas-switch-rewarm 12 (no FLOPs change; a remedy beyond the paper" in markdown
    assert "`ramp_loss_vs_tokens.png`, `ramp_loss_vs_time.png`" in markdown


def test_a_switch_without_an_evaluation_before_it_is_left_out():
    valid = [{"kind": "valid", "iteration": i, "lm_loss": loss, "in_training": True} for i, loss in ((25, 5.0), (50, 4.0))]
    fixed = report.ArmResult("fixed", {}, [{"kind": "switch", "iteration": 1}, *valid])
    assert report.switch_jumps(fixed) == []
    late = report.ArmResult("late", {}, [{"kind": "switch", "iteration": 60}, *valid])
    assert report.switch_jumps(late) == []  # no evaluation after it


def test_plan_arms_has_each_new_arm_once_per_seed(tmp_path):
    names = [a.name for a in plan_arms(SCALES["cpu"], tmp_path, parts=("scratch", "ablation", "fixed", "rewarm"))]
    assert len(names) == len(set(names)) == 9
    names = [a.name for a in plan_arms(SCALES["cpu"], tmp_path, parts=("scratch", "ablation", "fixed", "rewarm", "ramp"))]
    assert len(names) == len(set(names)) == 11
