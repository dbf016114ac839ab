"""epas-bench quality: the report's arithmetic against hand computations, and the recipe end to
end at the smoke scale (every number of the report recomputed from the runs' own files)."""

import json
import shlex
import subprocess

import pytest

from epas_megatron.experiments import quality_report as report
from epas_megatron.experiments.quality import QualityRecipe
from epas_megatron.experiments.quality_plan import SCALES, plan_arms


def arm(name, valid, train=(), **summary):
    """An ArmResult from (iteration, train_time_s, loss) validation points and training rows."""
    records = [{"kind": "valid", "iteration": i, "train_time_s": t, "lm_loss": l, "in_training": True} for i, t, l in valid]
    records += [{"iteration": i, "iteration_time_s": s, "tokens_per_s": 1000 / s} for i, s in train]
    return report.ArmResult(name, {"train_time_s": valid[-1][1], **summary}, records)


def test_time_to_target_interpolates_between_evaluations():
    points = [(10.0, 5.0), (20.0, 4.0), (30.0, 3.0)]
    assert report.time_to_target(points, 3.5) == pytest.approx(25.0)  # halfway from 4.0 at 20 s to 3.0 at 30 s
    assert report.time_to_target(points, 4.0) == 20.0  # reached exactly at an evaluation
    assert report.time_to_target(points, 6.0) == 10.0  # already at the first evaluation
    assert report.time_to_target(points, 2.9) is None  # never


def test_steady_state_throughput_counts_only_intervals_after_the_switch():
    # Records every 10 iterations of 1000 tokens; the interval 10-20 starts before iteration 15.
    a = arm("x", [(30, 9.0, 1.0)], train=[(10, 0.5), (20, 0.25), (30, 0.2)])
    # Intervals starting at >= 15: only (20, 30]: 10 iterations of 0.2 s -> 5000 tokens/s.
    assert report.steady_state_tokens_per_s(a, 15) == pytest.approx(5000.0)
    # From 10: (10, 20] and (20, 30]: 20 000 tokens in 2.5 + 2.0 s.
    assert report.steady_state_tokens_per_s(a, 10) == pytest.approx(20000 / 4.5)
    assert report.steady_state_tokens_per_s(a, 31) is None


def test_scratch_comparison_by_hand():
    base = arm("baseline", [(1, 10.0, 5.0), (2, 20.0, 4.0)], train=[(1, 10.0), (2, 10.0)], tokens_per_s=100.0)
    epas = arm("epas", [(1, 9.0, 5.0), (2, 18.0, 4.02)], train=[(1, 9.0), (2, 9.0)], tokens_per_s=110.0)
    result = report.scratch_comparison(base, epas, full_region_from=1)
    assert result["gap"] == pytest.approx(0.02) and result["within_paper_bound"]
    assert result["tokens_per_s_ratio"] == pytest.approx(1.1)
    assert result["steady_tokens_per_s_ratio"] == pytest.approx(10 / 9)
    assert result["train_time_ratio"] == pytest.approx(0.9)
    assert result["baseline_time_to_target_s"] == 20.0
    assert result["epas_time_to_target_s"] is None  # 4.02 never reaches 4.0
    table = report.scratch_table(result)
    assert "| EPAS | 4.0200 | +0.0200 |" in table and "not reached" in table
    summary = report.seed_summary([{"seed": 1, **result}, {"seed": 2, **{**result, "gap": 0.08, "baseline_final_valid_loss": 4.1}}])
    assert summary["mean_gap"] == pytest.approx(0.05) and summary["baseline_seed_spread"] == pytest.approx(0.1)
    assert "+0.0200 (seed 1), +0.0800 (seed 2); mean +0.0500, within" in report.seed_summary_text(summary)


def test_continual_comparison_and_verdict():
    epas = [{"region": 0, "lm_loss": 3.0}, {"region": 1, "lm_loss": 3.01}, {"region": 2, "lm_loss": 3.05}]
    base = [{"region": 0, "lm_loss": 2.98}, {"region": 1, "lm_loss": 3.2}, {"region": 2, "lm_loss": 3.48}]
    result = report.continual_comparison(epas, base)
    assert result["epas_gap_at_max_region"] == pytest.approx(0.05)
    assert result["baseline_gap_at_max_region"] == pytest.approx(0.5)
    assert result["epas_degrades_less"]
    assert "(10.0x less degradation)" in report.continual_verdict(result)
    assert "| 2 | 3.0500 (+0.0500) | 3.4800 (+0.5000) |" in report.continual_table(result)
    flipped = report.continual_comparison(base, epas)
    assert "does NOT hold here" in report.continual_verdict(flipped)


def test_arms_of_the_cpu_recipe(tmp_path):
    arms = {a.name: a for a in plan_arms(SCALES["cpu"], tmp_path)}
    assert list(arms) == ["scratch_baseline", "scratch_epas", "scratch_baseline_seed4321", "scratch_epas_seed4321",
                          "ablation_exclude_last", "continual_epas", "continual_baseline"]
    flags = lambda name: " ".join(arms[name].train_args)
    # Same data, seed, budget and schedule for both from-scratch arms; only EPAS differs.
    assert flags("scratch_epas").startswith(flags("scratch_baseline").replace(" --epas-target-layers 0", ""))
    assert "--epas-exclude-last 1" in flags("ablation_exclude_last")
    base = str(tmp_path / "scratch_baseline" / "run" / "checkpoints")
    assert f"--pretrained {base}" in flags("continual_epas") and arms["continual_epas"].needs == "scratch_baseline"
    assert "--eval-untrained-regions" in flags("continual_baseline")


def test_a_third_seed_adds_its_arms_and_keeps_the_others(tmp_path):
    two = {a.name: a.train_args for a in QualityRecipe("cpu", tmp_path, parts=("scratch", "fixed")).arms()}
    three = {a.name: a.train_args for a in QualityRecipe("cpu", tmp_path, parts=("scratch", "fixed"), seeds=(1234, 4321, 2024)).arms()}
    assert {name: args for name, args in three.items() if name in two} == two  # finished arms are reused as they are
    added = {name: " ".join(args) for name, args in three.items() if name not in two}
    assert sorted(added) == ["scratch_baseline_seed2024", "scratch_epas_seed2024", "scratch_fixed_seed2024"]
    assert all("--seed 2024" in args and "--seed 1234" not in args for args in added.values())
    proc = run_bench("--scale", "cpu", "--parts", "scratch,fixed", "--seeds", "1234,4321,2024", "--dry-run",
                     "--output-dir", str(tmp_path))
    assert proc.returncode == 0 and sorted(line.split(":")[0] for line in proc.stdout.splitlines()) == sorted(three)


def test_the_full_region_iteration_is_the_epas_arms_own_schedule(tmp_path):
    # By hand: the cpu scale's EPAS arm shares half of the small preset's 8 layers, one layer per
    # switch every 50 iterations from iteration 50: the fourth switch, at 50 + 3 * 50.
    assert SCALES["cpu"].epas_interval == 50 and SCALES["cpu"].target_layer_count() == 4
    assert QualityRecipe("cpu", tmp_path)._full_region_iteration() == 200
    # smoke: 4 layers of the tiny preset, target 2 of them, interval 2: switches at 2 and 4.
    assert QualityRecipe("smoke", tmp_path)._full_region_iteration() == 4


def test_arms_of_the_random_ltd_part(tmp_path):
    arms = {a.name: a for a in plan_arms(SCALES["cpu"], tmp_path, parts=("random_ltd",))}
    assert list(arms) == ["scratch_baseline", "scratch_epas", "scratch_random_ltd", "scratch_epas_random_ltd"]
    flags = lambda name: " ".join(arms[name].train_args)
    assert flags("scratch_random_ltd") == flags("scratch_baseline") + " --random-ltd"
    assert flags("scratch_epas_random_ltd") == flags("scratch_epas").replace(" --eval-regions 0,half,max", "") + " --random-ltd"
    # With the from-scratch part too, the shared arms are planned once.
    names = [a.name for a in plan_arms(SCALES["cpu"], tmp_path, parts=("scratch", "random_ltd"))]
    assert len(names) == len(set(names)) == 6


def test_methods_comparison_by_hand():
    # Records every 2 iterations; TFLOP/s x 1e12 x s/iter x devices x iterations = run FLOPs.
    def with_flops(name, tflops, loss, tokens_per_s, time_s):
        a = arm(name, [(4, time_s, loss)], tokens_per_s=tokens_per_s, world_size=2, iterations=4, global_batch_size=8, seq_length=16)
        a.records += [{"iteration": i, "iteration_time_s": 0.5, "tflops_per_device": tflops} for i in (2, 4)]
        return a

    base = with_flops("baseline", 1.0, 3.0, 100.0, 10.0)      # 2 x (1e12 x 0.5 x 2 x 2) = 4e12 FLOPs
    ltd = with_flops("random-ltd", 0.8, 3.1, 120.0, 8.0)      # 3.2e12
    rows = report.methods_comparison([base, ltd])
    assert rows[0]["run_flops"] == pytest.approx(4e12) and rows[1]["run_flops"] == pytest.approx(3.2e12)
    assert rows[1]["flop_limit_ratio"] == pytest.approx(1.25) and rows[1]["vs_baseline"] == pytest.approx(0.1)
    assert rows[1]["tokens_per_s_ratio"] == pytest.approx(1.2) and rows[1]["train_time_ratio"] == pytest.approx(0.8)
    assert rows[1]["tokens"] == 4 * 8 * 16
    assert "| random-ltd | 512 | 3.1000 | +0.1000 | 120 (1.200x) | 8.0 s (0.800x) | 1.250 |" in report.methods_table(rows)


def run_bench(*argv, launched=None):
    """``epas-bench quality argv`` through its ``main`` in this process: (exit status, stdout, stderr)
    as a CompletedProcess. Every arm's command after the first -- ``python -m epas_megatron.train``
    or ``epas_megatron.evaluate`` -- runs through that module's ``main`` in this process too
    (:func:`epas_testing._main_in_process`), its output written to the arm's log as the recipe
    writes it; the first command still runs as the recipe runs it, a process of its own, so the
    recipe's own launching stays under test. ``launched`` collects (command, in process?)."""
    import contextlib
    import io

    from epas_megatron.bench.cli import main
    from epas_megatron.experiments import quality
    from epas_testing import _main_in_process

    run_logged = quality._run_logged
    launched = [] if launched is None else launched

    def run_in_process(cmd, log_path, prefix, echo):
        if not launched or cmd[1:3] != ["-m", cmd[2]] or cmd[2] not in ("epas_megatron.train", "epas_megatron.evaluate"):
            launched.append((cmd, False))
            return run_logged(cmd, log_path, prefix, echo)
        launched.append((cmd, True))
        status, stdout, stderr = _main_in_process(cmd[3:], module=cmd[2])
        with open(log_path, "a") as log:
            log.write(f"$ {shlex.join(cmd)}\n{stdout}{stderr}")
        return status, stdout + stderr

    out, err = io.StringIO(), io.StringIO()
    quality._run_logged = run_in_process
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["quality", *argv])
    finally:
        quality._run_logged = run_logged
    return subprocess.CompletedProcess(["epas-bench", "quality", *argv], code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("argv, message", [
    (["--parts", "scratch,speed"], "--parts 'scratch,speed': choose among scratch, continual, ablation, random_ltd"),
    (["--scale", "tinyllama"], "--scale tinyllama is continual pretraining only: give --base-checkpoint"),
    (["--data", "x"], "--data needs --tokenizer-model"),
    (["--scale", "125m"], "--scale 125m (125m) has no --data: give --data PREFIX --tokenizer-model MODEL, or --data embedded"),
    (["--scale", "tinyllama", "--base-checkpoint", "x", "--data", "embedded"], "--scale tinyllama: give --data and --tokenizer-model"),
    (["--seeds", "1234,x"], "--seeds '1234,x': give non-negative integers separated by commas"),
    (["--seeds", "1234,1234"], "--seeds '1234,1234': a seed is listed twice"),
    (["--switch-ramp", "50"], "--switch-ramp 50: give 1 to 49 (below the --epas-interval 50 of --scale cpu)"),
    (["--switch-rewarm", "0", "--scale", "smoke"], "--switch-rewarm 0: give 1 to 1 (below the --epas-interval 2 of --scale smoke)"),
])
def test_bad_input(argv, message):
    proc = run_bench(*argv)
    assert proc.returncode == 2 and message in proc.stderr


def test_named_embedded_data_reaches_every_arm(tmp_path):
    """--data embedded (a GPU scale on the demo corpus, by name): every arm's command names it,
    with no --tokenizer-model."""
    proc = run_bench("--scale", "125m", "--data", "embedded", "--dry-run", "--output-dir", str(tmp_path / "q"))
    commands = [line for line in proc.stdout.splitlines() if ": " in line and "epas_megatron" in line]
    assert proc.returncode == 0 and commands, proc.stderr
    assert all("--data embedded" in line and "--tokenizer-model" not in line for line in commands)


def test_smoke_recipe_end_to_end(tmp_path):
    out = tmp_path / "quality"
    launched = []
    proc = run_bench("--scale", "smoke", "--output-dir", str(out), "--parts", "scratch,continual,ablation,random_ltd",
                     launched=launched)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The first arm ran as a process of its own (the recipe's launch), the other 6 arms and the 2 evaluations in process.
    assert [in_process for _, in_process in launched] == [False] + [True] * 8
    numbers = json.loads((out / "quality.json").read_text())
    summaries = {p.parent.name: json.loads(p.read_text()) for p in out.glob("*/summary.json")}
    assert set(summaries) == {"scratch_baseline", "scratch_epas", "ablation_exclude_last", "continual_epas", "continual_baseline",
                              "scratch_random_ltd", "scratch_epas_random_ltd"}
    # The gap is the difference of the two runs' own final validation losses.
    (scratch,) = numbers["scratch"]
    assert scratch["gap"] == pytest.approx(summaries["scratch_epas"]["final_valid_lm_loss"]
                                           - summaries["scratch_baseline"]["final_valid_lm_loss"])
    assert scratch["tokens_per_s_ratio"] == pytest.approx(summaries["scratch_epas"]["tokens_per_s"]
                                                          / summaries["scratch_baseline"]["tokens_per_s"])
    assert summaries["scratch_epas"]["sharing_layers"] == [2, 3] and summaries["ablation_exclude_last"]["sharing_layers"] == [1, 2]
    assert numbers["ablation"]["exclude_last_minus_default"] == pytest.approx(
        summaries["ablation_exclude_last"]["final_valid_lm_loss"] - summaries["scratch_epas"]["final_valid_lm_loss"])
    # Continual: both arms started from the baseline's weights; EPAS trained region 1, the other none.
    assert summaries["continual_epas"]["sharing_layers"] == [3] and summaries["continual_baseline"]["sharing_layers"] == []
    evals = {name: json.loads((out / name / "eval.json").read_text()) for name in ("continual_epas", "continual_baseline")}
    assert numbers["continual"]["epas"] == [r["lm_loss"] for r in evals["continual_epas"]["results"]]
    assert numbers["continual"]["baseline_inference_sharing"] == [r["lm_loss"] for r in evals["continual_baseline"]["results"]]
    for name in ("loss_vs_tokens.png", "loss_vs_time.png", "continual_regions.png", "random_ltd_loss_vs_tokens.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Random-LTD arms: same tokens, losses from their own summaries, fewer FLOPs than the baseline.
    rows = {r["arm"]: r for r in numbers["random_ltd"]}
    assert rows["scratch_random_ltd"]["vs_baseline"] == pytest.approx(
        summaries["scratch_random_ltd"]["final_valid_lm_loss"] - summaries["scratch_baseline"]["final_valid_lm_loss"])
    assert rows["scratch_random_ltd"]["tokens"] == rows["scratch_baseline"]["tokens"] == 8 * 4 * 64
    assert rows["scratch_random_ltd"]["flop_limit_ratio"] > 1 and rows["scratch_epas_random_ltd"]["flop_limit_ratio"] > 1
    assert summaries["scratch_epas_random_ltd"]["random_ltd"]["consumed_layer_tokens"] > 0
    markdown = (out / "quality.md").read_text()
    assert "### From scratch, seed 1234" in markdown and "### Continual pretraining" in markdown
    assert all(command in markdown for command in numbers["commands"])
    # A second invocation reuses every finished arm and writes the same numbers.
    again = run_bench("--scale", "smoke", "--output-dir", str(out), "--parts", "scratch,continual,ablation,random_ltd")
    assert again.returncode == 0 and again.stdout.count("finished before; reusing") == 7
    assert json.loads((out / "quality.json").read_text())["scratch"] == numbers["scratch"]
    # Another seed in the same directory plans arms of the same names with other flags: refused
    # before anything runs, naming the flag (arm.json, written when each arm started, says what ran).
    assert json.loads((out / "scratch_epas" / "arm.json").read_text())["train_args"] == \
        plan_arms(SCALES["smoke"], out, parts=("scratch",))[1].train_args
    launched = []
    other = run_bench("--scale", "smoke", "--output-dir", str(out), "--parts", "scratch", "--seeds", "99", launched=launched)
    assert other.returncode == 2 and not launched and "scratch_baseline run trained with other flags" in other.stderr
    assert "(--seed 99 now, 1234 then): use another --output-dir, or --force" in other.stderr
    # --force trains a finished arm again: its (planted) summary is replaced by the run's own.
    planted = out / "ablation_exclude_last" / "summary.json"
    planted.write_text(json.dumps({**summaries["ablation_exclude_last"], "final_valid_lm_loss": 99.0}))
    forced = run_bench("--scale", "smoke", "--output-dir", str(out), "--parts", "ablation", "--force", launched=[(None, False)])
    assert forced.returncode == 0 and "finished before" not in forced.stdout, forced.stdout[-3000:]
    assert json.loads(planted.read_text())["final_valid_lm_loss"] == pytest.approx(
        summaries["ablation_exclude_last"]["final_valid_lm_loss"], rel=1e-6)
    # --base-checkpoint: the continual arms start from the given checkpoint and no from-scratch arm
    # runs; from the same baseline checkpoint they give the default recipe's continual numbers.
    base = out / "scratch_baseline" / "run" / "checkpoints"
    given = run_bench("--scale", "smoke", "--output-dir", str(tmp_path / "given"), "--parts", "continual",
                      "--base-checkpoint", str(base), launched=[(None, False)])
    assert given.returncode == 0, given.stdout[-3000:] + given.stderr[-3000:]
    assert sorted(p.parent.name for p in (tmp_path / "given").glob("*/summary.json")) == ["continual_baseline", "continual_epas"]
    assert f"--pretrained {base}" in given.stdout
    assert json.loads((tmp_path / "given" / "quality.json").read_text())["continual"] == numbers["continual"]


def test_the_flags_an_arm_was_trained_with(tmp_path):
    """arm.json, or for arms of older recipes the first command of train.log (a later --load
    resume appends its own); an arm with neither, or a run that never started, has none."""
    from epas_megatron.experiments.quality import flag_differences, recorded_train_args

    old, new, empty = tmp_path / "old", tmp_path / "new", tmp_path / "empty"
    for directory in (old, new, empty):
        directory.mkdir()
    (old / "train.log").write_text(
        "$ /venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 -m epas_megatron.train --seed 1 "
        "--data a 'b c' --output-dir /x/old/run\nlog line\n$ python -m epas_megatron.train --seed 2 --output-dir /x/old/run "
        "--load /x/old/run/checkpoints\n")
    assert recorded_train_args(old) == ["--seed", "1", "--data", "a", "b c"]
    (new / "train.log").write_text("$ python -m epas_megatron.train --seed 5 --output-dir /x/new/run\n")
    (new / "arm.json").write_text(json.dumps({"train_args": ["--seed", "3"]}))
    assert recorded_train_args(new) == ["--seed", "3"]
    assert recorded_train_args(empty) is None
    (empty / "train.log").write_text("Traceback (most recent call last):\n")
    assert recorded_train_args(empty) is None
    assert flag_differences(["--seed", "1", "--data", "a", "b", "--epas-blocks", "2"],
                            ["--seed", "4", "--data", "a", "b", "--random-ltd"]) == \
        "--seed 4 now, 1 then; --random-ltd now only; --epas-blocks 2 then only"
    assert flag_differences(["--a", "1", "--b", "2"], ["--b", "2", "--a", "1"]) == ""


def test_a_kept_arm_with_other_flags_is_refused_unless_forced(tmp_path):
    """Only arms the recipe would reuse (summary.json) or resume (a checkpoint) are checked; one
    with neither starts again anyway."""
    from epas_megatron.errors import ConfigError
    from epas_megatron.experiments.quality_plan import ArmSpec

    for name in ("finished", "saved", "unsaved"):
        (tmp_path / name / "run" / "checkpoints").mkdir(parents=True)
        (tmp_path / name / "arm.json").write_text(json.dumps({"train_args": ["--seed", "1"]}))
    (tmp_path / "finished" / "summary.json").write_text("{}")
    (tmp_path / "saved" / "run" / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("10")
    recipe = QualityRecipe("smoke", tmp_path, echo=lambda line: None)
    recipe.check_reusable([ArmSpec(name, ["--seed", "1"]) for name in ("finished", "saved")] + [ArmSpec("unsaved", ["--seed", "2"])])
    # the same flags in another order train the same run
    (tmp_path / "finished" / "arm.json").write_text(json.dumps({"train_args": ["--seed", "1", "--lr", "0.1"]}))
    recipe.check_reusable([ArmSpec("finished", ["--lr", "0.1", "--seed", "1"])])
    (tmp_path / "finished" / "arm.json").write_text(json.dumps({"train_args": ["--seed", "1"]}))
    for name in ("finished", "saved"):
        with pytest.raises(ConfigError, match=f"{name} holds a {name} run trained with other flags .*--seed 2 now, 1 then"):
            recipe.check_reusable([ArmSpec(name, ["--seed", "2"])])
        QualityRecipe("smoke", tmp_path, force=True).check_reusable([ArmSpec(name, ["--seed", "2"])])


def test_an_interrupted_arm_resumes_from_its_checkpoint_or_starts_again(tmp_path, monkeypatch):
    """An arm without summary.json: with a checkpoint (a SIGTERM saved one) its command gets
    --load of it; without one its run directory is removed first (the trainer refuses an output
    directory holding another run); --force always starts from scratch."""
    from epas_megatron.experiments import quality
    from epas_megatron.experiments.quality import QualityRecipe
    from epas_megatron.experiments.quality_plan import ArmSpec

    ran = []

    def fake_run(cmd, log_path, prefix, echo):
        ran.append((cmd, (tmp_path / prefix / "run").exists()))
        return 0, 'SUMMARY {"exit_reason": "completed", "final_valid_lm_loss": 4.5}\n'

    monkeypatch.setattr(quality, "_run_logged", fake_run)
    saved, unsaved = tmp_path / "saved" / "run", tmp_path / "unsaved" / "run"
    (saved / "checkpoints").mkdir(parents=True)
    (saved / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("120")
    unsaved.mkdir(parents=True)
    (unsaved / "config.yaml").write_text("{}")
    recipe = QualityRecipe("smoke", tmp_path, echo=lambda line: None)
    for name in ("saved", "unsaved"):
        assert recipe.run_arm(ArmSpec(name, ["--seed", "1"]))["final_valid_lm_loss"] == 4.5
    (saved_cmd, saved_kept), (unsaved_cmd, unsaved_kept) = ran
    assert saved_cmd[-2:] == ["--load", str(saved / "checkpoints")] and saved_kept
    assert "--load" not in unsaved_cmd and not unsaved_kept
    forced = QualityRecipe("smoke", tmp_path, force=True, echo=lambda line: None)
    forced.run_arm(ArmSpec("saved", ["--seed", "1"]))
    assert "--load" not in ran[-1][0] and not ran[-1][1]
