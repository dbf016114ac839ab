"""epas-plan (the "will it fit" report) and the launcher's DRY_RUN=1: FLOPs, layouts per switch,
memory per GPU at the first and final region, fit / no fit."""

import os
import subprocess
import sys

import pytest

from epas_megatron.config.presets import get_preset
from epas_megatron.metrics.flops import Convention, flops_per_iteration
from epas_megatron.model.architecture import ModelShape, architecture_from_preset
from epas_testing import REPO


def plan(*args):
    """``epas-plan args`` through its ``main`` in this process (the installed command itself runs
    in tests/test_entry_points.py): (exit status, stdout, stderr)."""
    import contextlib
    import io

    from epas_megatron.plan import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["epas-plan", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "error: --world-size must be >= 1, got 0"),
    (["--world-size", "-2"], "error: --world-size must be >= 1, got -2"),
    (["--gpu-memory-gb", "0"], "error: --gpu-memory-gb must be > 0, got 0.0"),
    (["--world-size", "2", "--pp", "4"], "error: --world-size 2 is not a multiple of --tp 1 x --pp 4: set --world-size"),
    (["--epas-target-layers", "4"], "error: --epas-target-layers"),
])
def test_refusals(argv, message, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    proc = plan("--preset", "tiny", "--output-dir", str(tmp_path / "r"), *argv)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(message), proc.stderr
    assert not proc.stdout and not (tmp_path / "r").exists()


def test_the_world_defaults_to_tp_times_pp(tmp_path, monkeypatch):
    """A planner runs no processes: without --world-size (or $WORLD_SIZE) it plans one
    data-parallel replica of --tp x --pp."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    proc = plan("--preset", "tiny", "--tp", "2", "--pp", "2", "--output-dir", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "world 4 = TP 2 x PP 2 x DP 1" in proc.stdout


def test_7b_on_one_node_of_80gb_gpus_fits(tmp_path):
    proc = plan("--world-size", "8", "--gpu-memory-gb", "80", "--config", "launch/configs/7b.yaml", "--output-dir", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "world 8 = TP 2 x PP 2 x DP 2" in out and "distributed optimizer" in out
    baseline = flops_per_iteration(ModelShape(architecture_from_preset(get_preset("7b")), 2048), 1024, 0, convention=Convention.MEGATRON)
    assert f"{baseline / 1e15:.3f} PFLOP at region 0" in out
    assert "iteration 24800: 16 sharing layers" in out  # the layout planned for the last switch
    assert out.count("  pp rank  parameters+grads+Adam") == 2 and "(budget 72.0 GiB)" in out
    assert "(2)" in out and out.rstrip().endswith("fits")


def test_a_run_that_does_not_fit_says_so(tmp_path):
    proc = plan("--world-size", "1", "--gpu-memory-gb", "0.002", "--preset", "tiny", "--output-dir", str(tmp_path / "r"))
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "DOES NOT FIT" in proc.stdout and "does NOT fit" in proc.stdout


def test_a_budget_no_layout_meets_is_an_error(tmp_path):
    proc = plan("--world-size", "2", "--preset", "tiny", "--pp", "2", "--epas-target-layers", "2", "--epas-interval", "10",
                "--epas-memory-budget-gb", "0.000001", "--output-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "--epas-memory-budget-gb" in proc.stderr, proc.stderr[-2000:]


def test_launcher_dry_run_shows_the_report(tmp_path):
    env = {"CONFIG": "launch/configs/tiny.yaml", "NPROC_PER_NODE": "2", "DRY_RUN": "1", "EXTRA_ARGS": ""}
    proc = subprocess.run([sys.executable, "launch/launch.py", "--pp", "2", "--output-dir", str(tmp_path / "r")], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[launch] command:" in proc.stdout and "memory per GPU at the first region" in proc.stdout


def test_a_plan_for_gpus_counts_the_gpus_kernels(tmp_path):
    """--gpu-memory-gb plans for a GPU node from here: the activations are the memory model's with
    the GPU's one-kernel RMSNorm and fused SwiGLU (hand-built settings), not this CPU's kernels."""
    from epas_megatron.metrics.rank_memory import RankMemorySettings, rank_memory_bytes

    proc = plan("--world-size", "1", "--gpu-memory-gb", "80", "--preset", "small", "--micro-batch-size", "16",
                "--output-dir", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("0 "))
    shown = float(row.split("GiB")[1])
    shape = ModelShape(architecture_from_preset(get_preset("small")), 256, 16)
    activations = {fused: rank_memory_bytes(shape, [["compute"] * 8], 0, 1, 1, RankMemorySettings(
        precision="bf16", distributed_optimizer=True, fused_norm=fused, fused_swiglu=fused))["activations"] / 2**30
        for fused in (True, False)}
    assert f"{shown:.2f}" == f"{activations[True]:.2f}" != f"{activations[False]:.2f}", (row, activations)


@pytest.mark.parametrize("backend", ["local", "transformer_engine"])
@pytest.mark.parametrize("random_ltd", [False, True])
def test_the_memory_models_kernels_are_the_builders(monkeypatch, backend, random_ltd):
    """``memory_kernels`` (what epas-plan, the memory budget and the GPU suite give the memory
    model) says RoPE is fused exactly where the model builder turns ``apply_rope_fusion`` on:
    on a GPU with Transformer Engine, either layer backend, not with Random-LTD -- read off the
    ``TransformerConfig`` the builder makes (TE's kernel stood in for: it cannot load here)."""
    from megatron.core.models.common.embeddings import rope_utils

    from epas_megatron.assembly import memory_kernels
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import make_transformer_config
    from epas_megatron.model.fusions import ASSUMED_GPU, KernelAvailability
    from epas_megatron.random_ltd.option import RandomLTDSettings

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)  # (TransformerConfig checks it exists)
    arch = LlamaArchitecture(4, 64, 4, 2, 176, 512, 64)
    plan = BuildPlan.for_region(arch, (), seq_length=64, backend=backend,
                                options=(RandomLTDSettings((1, 2)),) if random_ltd else ())
    te_gpu = KernelAvailability(cuda=True, te_rope=True, apex_softmax=False, apex_gradient_accumulation=False)
    cpu = KernelAvailability(cuda=False, te_rope=False, apex_softmax=False, apex_gradient_accumulation=False)
    for kernels in (cpu, ASSUMED_GPU, te_gpu):
        built = make_transformer_config(plan, kernels).apply_rope_fusion
        assert memory_kernels(kernels, backend, plan.options)["fused_rope"] == built, kernels
    assert memory_kernels(te_gpu, backend, plan.options)["fused_rope"] is not random_ltd


def test_an_in_memory_switch_that_does_not_fit_says_so(tmp_path):
    """Every region fits the budget, but the in-memory switch does not: fp32 with the distributed
    optimizer, whose switch holds the weights in Megatron's old DDP parameter buffer while the new
    one is built (the one whole piece a switch allocates). Exit 3, the switch's rank flagged and
    its peak above the steps around it; the same run switching through a checkpoint fits. The
    shown peak is the parameter state plus the memory model's bound for that switch."""
    from epas_megatron.metrics.rank_memory import RankMemorySettings, rank_memory_bytes
    from epas_megatron.metrics.switch_memory import switch_transient_terms

    args = ["--world-size", "1", "--gpu-memory-gb", "80", "--preset", "small", "--micro-batch-size", "1",
            "--use-distributed-optimizer", "--precision", "fp32", "--epas-target-layers", "2", "--epas-interval", "10",
            "--train-iters", "40", "--epas-memory-budget-gb", "0.345"]
    proc = plan(*args, "--output-dir", str(tmp_path / "m"))
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "DOES NOT FIT" not in proc.stdout.split("largest in-memory switch")[0]  # every region fits
    row = next(line for line in proc.stdout.split("largest in-memory switch")[1].splitlines() if line.strip().startswith("0 "))
    assert "DOES NOT FIT" in row and "(switch at iteration 10)" in row
    assert "the switch peaks above the steps around it on pp rank(s) 0" in proc.stdout
    assert proc.stdout.rstrip().endswith("(--epas-switch-mode checkpoint)")
    # The figures: the largest switch is the first (region 0 -> 1: the most trainable
    # parameters before it).
    shape = ModelShape(architecture_from_preset(get_preset("small")), 256)
    settings = RankMemorySettings(precision="fp32", distributed_optimizer=True, fused_norm=True,
                                  fused_swiglu=True)
    before, after = ["compute"] * 8, ["compute"] * 7 + ["share"]
    parameters = rank_memory_bytes(shape, [before], 0, 1, 1, settings)["parameters"]
    transient = switch_transient_terms(shape, before, after, range(8), range(8), 0, 1, settings)["transient"]
    step = max(rank_memory_bytes(shape, [roles], 0, 1, 1, settings)["total"] for roles in (before, after))
    shown = [float(part.split()[-1]) for part in row.split("GiB")[:4]]
    assert shown == [round(v / 2**30, 2) for v in (parameters, transient, parameters + transient, step)], row
    assert parameters + transient > 0.345 * 2**30 > step
    staged = plan(*args, "--epas-switch-mode", "checkpoint", "--output-dir", str(tmp_path / "c"))
    assert staged.returncode == 0 and "in-memory switch" not in staged.stdout, staged.stdout[-3000:]


def test_the_7b_switch_peaks_below_its_steps(tmp_path):
    """The 7B config (bf16, distributed optimizer, TP 2 x PP 2 x DP 2, re-layouts at switches):
    every rank's largest in-memory switch peaks below the steps around it (before the switch
    built on the meta device it peaked 7 GiB above: 31.4 / 31.8 GiB against 24.4 / 21.8)."""
    import re

    proc = plan("--config", "launch/configs/7b.yaml", "--world-size", "8", "--gpu-memory-gb", "80",
                "--output-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    section = proc.stdout.split("largest in-memory switch")[1]
    rows = [line for line in section.splitlines()[2:4]]
    for row in rows:
        state, transient, peak, step = (float(x) for x in re.findall(r"([\d.]+) GiB", row))
        assert peak < step and transient < 0.05 * state, row
    assert "every switch peaks below the steps around it" in section


def test_mlp_recompute_in_the_plan(tmp_path):
    """--recompute-modules mlp reaches the memory model through the assembly: each rank's
    activations shrink by the MLP's fc1 and SwiGLU terms (the model's own, per in-flight
    micro-batch), the parameters stay."""
    import re

    from epas_megatron.assembly import memory_settings
    from epas_megatron.config.cli import parse_config
    from epas_megatron.validation import resolve_run

    common = ["--world-size", "8", "--gpu-memory-gb", "80", "--config", "launch/configs/7b.yaml", "--recompute", "selective"]
    rows = {}
    for name, extra in (("attention", []), ("mlp", ["--recompute-modules", "core_attn", "mlp"])):
        proc = plan(*common, *extra, "--output-dir", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr[-2000:]
        first = proc.stdout.split("memory per GPU at the first region")[1].splitlines()[2]  # pp rank 0
        rows[name] = [float(x) for x in re.findall(r"([\d.]+) GiB", first)]
    assert rows["mlp"][0] == rows["attention"][0]  # parameters
    assert rows["mlp"][1] < 0.75 * rows["attention"][1]  # activations: the MLP's terms are most of a layer's
    run = resolve_run(parse_config(["--config", "launch/configs/7b.yaml", "--recompute", "selective", "--recompute-modules", "mlp",
                                    "--output-dir", str(tmp_path / "r")]), world_size=8, cuda=True, planning_only=True)
    assert memory_settings(run).recompute_modules == ("mlp",)


def test_v_placement_in_the_plan(tmp_path):
    """--pipeline-schedule v-1f1b: each rank's memory with its two V chunks, the embedding and the
    LM head both on rank 0, and the schedule's own peak along the rank's list, each chunk's passes
    weighed by their bytes: at p = 2 rank 1 keeps two passes of each of its (equal) chunks -- 2
    micro-batches; rank 0 runs F0.0 F3.0 BW3.0 F0.1 F3.1 ..., so it keeps two passes of chunk 0
    (8 layers and the embedding) and one of chunk 1 (8 layers, the head and the loss): in flight
    (2 f0 + f3) / (f0 + f3), a little under 1.5 as the head's logits outweigh the token ids (1F1B:
    2 and 1). Through an in-memory switch too, rank 0 holds both ends: the state before its
    largest switch is its first region's parameter state, above rank 1's."""
    import re

    from epas_megatron.parallel.pipeline_schedule import build_schedule

    assert [str(a) for a in build_schedule("v-1f1b", 2, 512).ranks[0][:6]] == ["F0.0", "F3.0", "BW3.0", "F0.1", "F3.1", "BW3.1"]
    proc = plan("--world-size", "8", "--gpu-memory-gb", "80", "--config", "launch/configs/7b.yaml", "--pipeline-schedule", "v-1f1b",
                "--epas-rebalance", "off", "--output-dir", str(tmp_path / "v"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    block = proc.stdout.split("memory per GPU at the first region (0 layers sharing), v-1f1b, V placement (8, 8, 8, 8)")[1]
    rows = [[float(x) for x in re.findall(r"([\d.]+) GiB", line)] + [float(re.search(r"\(([\d.]+)\)", line).group(1))]
            for line in block.splitlines()[2:4]]
    assert rows[1][3] == 2.0
    layer = rows[1][1] / 32  # rank 1: 2 x (8 + 8) layers
    f0_plus_f3 = rows[0][1] / rows[0][3]
    f0 = rows[0][1] - f0_plus_f3  # two passes of chunk 0 and one of chunk 1, less one of each
    assert f0 == pytest.approx(8 * layer, rel=0.01)  # (the token ids: 32 KiB)
    assert 1.4 < rows[0][3] < 1.5
    assert rows[0][0] > rows[1][0]  # rank 0 holds the embedding and the head (and a table's optimizer state)
    switch = proc.stdout.split("memory per GPU through its largest in-memory switch")[1].splitlines()[2:4]
    before = [[float(x) for x in re.findall(r"([\d.]+) GiB", line)] for line in switch]
    assert before[0][0] == rows[0][0] > before[1][0] and all(b[1] > 0 and b[2] == pytest.approx(b[0] + b[1], abs=0.011) for b in before)


def test_pass_costs_by_hand():
    """F / B / W of one micro-batch through one rank's share, from the FLOPs: tiny shape (4 layers,
    h 64, 4 heads, 2 KV groups, FFN 176, vocab 256), s 32, b 2, p 2. Per layer and sequence the
    GEMMs: Q and the output projection 2·s·h·h each, K and V 2·s·h·(g·d) each, the MLP 3·2·s·h·F;
    the attention core 2·s²·h for scores and for values, halved for the causal mask; the head
    2·s·h·V. F = GEMMs + core, B = GEMMs + 2 core, W = GEMMs; times b / p = 1."""
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.plan import pass_costs

    s, h, gd, f, v = 32, 64, 32, 176, 256
    gemms = 4 * (2 * s * h * h * 2 + 2 * s * h * gd * 2 + 3 * 2 * s * h * f) + 2 * s * h * v
    core = 4 * 2 * (2 * s * s * h // 2)
    costs = pass_costs(LlamaArchitecture(4, 64, 4, 2, 176, 256, 32), 32, 2, 2)
    assert (costs.forward, costs.input_grad, costs.weight_grad) == (gemms + core, gemms + 2 * core, gemms)


def test_schedule_times_by_hand():
    """Equal stages: 1F1B's iteration is (m + p - 1)(F + B + W); Megatron's interleaved one
    m (F + B + W) plus its bubble (p - 1)(F + B + W) / vpp (Narayanan et al., 2021). Stage costs
    from the layer and head costs: each stage its layers', the last also the head's."""
    from epas_megatron.parallel.schedule_simulation import PassCosts
    from epas_megatron.plan import schedule_time, stage_costs

    equal = PassCosts(3.0, 4.0, 2.0)
    assert schedule_time("1f1b", 4, 8, {s: equal for s in range(4)}) == (pytest.approx(11 * 9), pytest.approx(3 / 11))
    halves = {s: PassCosts(1.5, 2.0, 1.0) for s in range(8)}  # vpp 2: each chunk half a rank's work
    assert schedule_time("interleaved", 4, 8, halves, vpp=2) == (pytest.approx(8 * 9 + 3 * 9 / 2), pytest.approx(1 - 72 / 85.5))
    costs = stage_costs(PassCosts(1.0, 2.0, 3.0), PassCosts(10.0, 10.0, 10.0), (2, 1, 3))
    assert costs == {0: PassCosts(2.0, 4.0, 6.0), 1: PassCosts(1.0, 2.0, 3.0), 2: PassCosts(13.0, 16.0, 19.0)}


def test_the_schedule_choice_by_hand():
    """The fastest schedule that fits; the run's own where the fastest gains at most 1% (the p2p
    time is not modelled); none when nothing fits."""
    from epas_megatron.plan import ScheduleOption, choose_schedule

    def options(*specs):
        return [ScheduleOption(name, [], time, 0.0, fits, 0) for name, time, fits in specs]

    hand = options(("1f1b", 1.000, False), ("v-1f1b", 1.000, True), ("v-half", 0.995, True), ("v-min", 1.034, True))
    assert choose_schedule(hand, "1f1b") == "v-half"  # 1F1B does not fit; V-Half is the fastest of the rest
    assert choose_schedule(hand, "v-1f1b") == "v-1f1b"  # within 1% of V-Half: the run's own stays
    assert choose_schedule(hand, "v-min") == "v-half"  # 3.9% slower than V-Half
    assert choose_schedule(options(("1f1b", 1.0, False), ("v-min", 1.03, False)), "1f1b") is None


def test_7b_on_8_gpus_of_40gb_fits_only_with_a_v_schedule(tmp_path):
    """TP 1 x PP 4 x DP 2, micro-batch 2 (256 micro-batches), the even layout (--epas-rebalance
    off): 1F1B's rank 0 keeps 4 micro-batches of 8 layers and does not fit the 36 GiB budget (90%
    of 40 GB); v-1f1b and V-Half keep about 3 (the paper's 3/4 p and (p + 2) // 2) and V-Min 2
    ((p + 4) // 3), and all three fit; V-Half is the fastest (the least bubble). The run as given
    exits 3 naming --pipeline-schedule v-half; run so, it fits and keeps its own schedule. The
    1F1B row's figures are those of the report's own per-rank table."""
    import re

    args = ["--world-size", "8", "--gpu-memory-gb", "40", "--config", "launch/configs/7b.yaml", "--tp", "1", "--pp", "4",
            "--micro-batch-size", "2", "--epas-rebalance", "off"]
    proc = plan(*args, "--output-dir", str(tmp_path / "a"))
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    out = proc.stdout
    table = out.split("pipeline schedules compared")[1]
    rows = {line.split()[0]: line for line in table.splitlines()[2:6]}
    assert list(rows) == ["1f1b", "v-1f1b", "v-half", "v-min"]
    assert rows["1f1b"].endswith("DOES NOT FIT (rank 0)") and all(rows[n].endswith("fits") for n in ("v-1f1b", "v-half", "v-min"))
    first = out.split("memory per GPU at the first region")[1].splitlines()[2:6]
    totals = [float(re.findall(r"([\d.]+) GiB", line)[2]) for line in first]
    assert rows["1f1b"].split("%")[1].split("|")[0].split() == [f"{t:.1f}" for t in totals] and totals[0] > 36
    units = {name: float(rows[name].split()[2].lstrip("(")) for name in rows}
    assert units == {"1f1b": 4, "v-1f1b": 3, "v-half": 3, "v-min": 2}
    assert "schedule choice: v-half, the fastest that fits the budget (this run: --pipeline-schedule 1f1b)" in out
    assert out.rstrip().endswith("or --pipeline-schedule v-half, which fits (compared above)")
    chosen = plan(*args, "--pipeline-schedule", "v-half", "--output-dir", str(tmp_path / "b"))
    assert chosen.returncode == 0, chosen.stdout[-3000:] + chosen.stderr[-2000:]
    assert "schedule choice: v-half, the fastest that fits the budget -- the run's own" in chosen.stdout
    # With stage rebalancing (the config's default) 1F1B fits too, on a memory-constrained layout
    # whose slowest rank is slower than the even split's: V-Half is still the faster choice.
    rebalanced = plan(*args[:-2], "--output-dir", str(tmp_path / "c"))
    assert rebalanced.returncode == 0, rebalanced.stdout[-3000:] + rebalanced.stderr[-2000:]
    assert "memory budget: the FLOP-optimal layout" in rebalanced.stdout
    rows = {line.split()[0]: line for line in rebalanced.stdout.split("pipeline schedules compared")[1].splitlines()[2:6]}
    assert rows["1f1b"].endswith("fits") and float(rows["v-half"].split()[6]) < 0.99
    assert "schedule choice: v-half, the fastest that fits the budget (this run: --pipeline-schedule 1f1b)" in rebalanced.stdout


def test_schedules_a_run_cannot_use_are_named_with_the_reason(tmp_path):
    """V schedules are left out of the comparison where the run's validation would refuse them
    (here --overlap-grad-reduce), with the reason; without a budget the fastest is named."""
    common = ["--world-size", "2", "--preset", "tiny", "--pp", "2", "--global-batch-size", "16"]  # 8 micro-batches
    proc = plan(*common, "--overlap-grad-reduce", "--output-dir", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = proc.stdout.split("pipeline schedules compared")[1]
    for name in ("v-1f1b", "v-half", "v-min"):
        assert (f"  {name}: not applicable (--pipeline-schedule {name} does not run with --overlap-grad-reduce (the "
                "executor reduces after the iteration) yet; drop it or use --pipeline-schedule 1f1b)") in table
    assert "schedule choice: 1f1b, the fastest (no budget given) -- the run's own" in table
    assert "memory per pp rank in MiB" in table  # a tiny model's figures
    fewer = plan(*common[:-1], "2", "--output-dir", str(tmp_path / "f"))  # 1 micro-batch: fewer than --pp
    assert ("  v-min: not applicable (--pipeline-schedule v-min with --pp 2 needs at least 2 micro-batches per "
            "iteration, got 1: raise --global-batch-size or lower --micro-batch-size)") in fewer.stdout
    free = plan(*common, "--output-dir", str(tmp_path / "v")).stdout.split("pipeline schedules compared")[1]
    assert [line.split()[0] for line in free.splitlines()[2:6]] == ["1f1b", "v-1f1b", "v-half", "v-min"]


def test_mixture_of_channels_in_the_plan(tmp_path):
    """--moc-topk reaches the memory model through the assembly: each rank's activations shrink
    (the dense MLP's fc1 and SwiGLU terms are most of a layer's; the sparse form replacing them is
    checked against the measurement in tests/metrics/test_activation_memory.py), the parameters
    stay. Local layers: a MoC run with Transformer Engine's is refused."""
    import re

    from epas_megatron.assembly import memory_settings
    from epas_megatron.config.cli import parse_config
    from epas_megatron.model.moc_sizes import MoCSettings
    from epas_megatron.validation import resolve_run

    common = ["--world-size", "8", "--gpu-memory-gb", "80", "--config", "launch/configs/7b.yaml", "--transformer-impl", "local"]
    rows = {}
    for name, extra in (("dense", []), ("moc", ["--moc-topk", "0.2"])):
        proc = plan(*common, *extra, "--output-dir", str(tmp_path / name))
        assert proc.returncode in (0, 3), proc.stderr[-2000:]
        first = proc.stdout.split("memory per GPU at the first region")[1].splitlines()[2]  # pp rank 0
        rows[name] = [float(x) for x in re.findall(r"([\d.]+) GiB", first)]
    assert rows["moc"][0] == rows["dense"][0]  # parameters
    assert rows["moc"][1] < 0.75 * rows["dense"][1]  # activations
    run = resolve_run(parse_config([*common[4:], "--moc-topk", "0.2", "--output-dir", str(tmp_path / "r")]), world_size=8, cuda=True,
                      planning_only=True)
    assert memory_settings(run).moc == MoCSettings(0.2, 8)
