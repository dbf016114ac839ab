"""Every weight load reaches the fp32 main weights, in bf16 and fp16, and the model still learns.

The mixed-precision and distributed optimizers copy their fp32 main weights from the model when
they are built; a build whose weights are loaded afterwards must refresh them, or the first
optimizer step writes stale memory into the model. The loads: ``--pretrained``, a resume of a
checkpoint saved without optimizer state, and an EPAS switch before the first successful
optimizer step (both switch modes). For each, with the plain and the distributed optimizer:

- right after the load, every main weight equals its (upcast) model weight -- read from
  Megatron's own optimizer fields (:func:`epas_testing.main_weight_mismatches`);
- the run's losses follow the fp32 run of the same configuration (bf16: within 2% per
  iteration, as everywhere in the suite; fp16 with a unit loss scale: within 0.5%), or equal an
  uninterrupted run of the same precision bit for bit where the two must be the same computation;
- the model learns afterwards (the last loss well below the first).

PP=2 and DP=2 (distributed optimizer sharded over two ranks) run the same checks under torchrun
in one launch (``scripts/precision_loads.py``), against the one-process fp32 references.
Runs here are in-process (no interpreter start per run).
"""

import json

import pytest

from epas_testing import REPO, TINY, json_lines, main_weight_mismatches, run_script, train_in_process

ARGS = [*TINY, "--train-iters", "10", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--seed", "3", "--init-method-std", "0.1", "--lr", "3e-3", "--lr-warmup-iters", "2"]
# Switches at iterations 1 ([3]: before any optimizer step) and 3 ([2, 3]).
EARLY_SWITCHES = ["--epas-target-layers", "2", "--epas-interval", "2", "--epas-first-switch", "1"]
TOLERANCE = {"bf16": 2e-2, "fp16": 5e-3}
FP16_UNIT_SCALE = ["--loss-scale", "1"]


def check_main_weights(trainer, what):
    """``after_load`` hook: where no optimizer state was loaded, main weights == model weights."""
    from epas_megatron.checkpointing.checkpoint import optimizer_has_state

    if not optimizer_has_state(trainer.optimizer):
        assert main_weight_mismatches(trainer.optimizer) == [], f"after {what}"
        check_main_weights.checked.append(what)


def assert_follows(run, reference, precision):
    assert run.returncode == 0, run.stdout[-2000:]
    assert run.losses.keys() == reference.losses.keys()
    for iteration, loss in reference.losses.items():
        assert abs(run.losses[iteration] - loss) <= TOLERANCE[precision] * loss, (iteration, run.losses[iteration], loss)


def assert_learns(run):
    losses = [run.losses[i] for i in sorted(run.losses)]
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.fixture(autouse=True)
def _checked():
    check_main_weights.checked = []


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """An fp32 checkpoint to start from (the paper's continual pretraining, in small), trained on
    other samples (another seed orders the data), so the continuation's losses show learning."""
    run = train_in_process([*ARGS, "--train-iters", "4", "--seed", "5"], tmp_path_factory.mktemp("base") / "run")
    return run.output_dir / "checkpoints"


@pytest.fixture(scope="module")
def fp32_pretrained(base, tmp_path_factory):
    return train_in_process([*ARGS, "--pretrained", str(base)], tmp_path_factory.mktemp("fp32p") / "run")


@pytest.fixture(scope="module")
def fp32_switches(tmp_path_factory):
    return train_in_process([*ARGS, *EARLY_SWITCHES], tmp_path_factory.mktemp("fp32s") / "run")


@pytest.mark.parametrize("precision,extra", [("bf16", []), ("fp16", FP16_UNIT_SCALE), ("bf16", ["--use-distributed-optimizer"])],
                         ids=["bf16", "fp16", "bf16-distributed-optimizer"])
def test_pretrained_weights_reach_the_main_weights(base, fp32_pretrained, tmp_path, precision, extra):
    run = train_in_process([*ARGS, "--precision", precision, *extra, "--pretrained", str(base)], tmp_path / "run",
                           after_load=check_main_weights)
    assert check_main_weights.checked == ["setup"]
    assert_follows(run, fp32_pretrained, precision)
    assert_learns(run)


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer"]], ids=["plain", "distributed-optimizer"])
def test_bf16_resume_without_optimizer_state_equals_the_fresh_run(tmp_path, extra):
    """A checkpoint of the initial weights (what ``epas-convert hf-import`` writes: no optimizer
    state) resumed in bf16 is the fresh bf16 run, bit for bit."""
    from epas_megatron.config.cli import parse_config
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    args = [*ARGS, "--precision", "bf16", *extra]
    fresh = train_in_process(args, tmp_path / "fresh")
    trainer = Trainer(resolve_run(parse_config([*args, "--output-dir", str(tmp_path / "initial")]), world_size=1))
    trainer.setup()
    try:
        saved = trainer.save()
    finally:
        trainer.close()
    assert json.loads((saved / "run_meta.json").read_text())["has_optimizer_state"] is False
    resumed = train_in_process([*args, "--load", str(saved)], tmp_path / "resumed", after_load=check_main_weights)
    assert check_main_weights.checked == ["setup"]
    assert resumed.losses == fresh.losses
    assert_learns(resumed)


# fp16 with dynamic loss scaling from 2^16: the tiny model's first seven steps overflow (skipped,
# no optimizer state), the first update is at iteration 8.
FP16_WARM_UP = ["--train-iters", "16", "--precision", "fp16", "--initial-loss-scale", str(2.0**16)]


def assert_learns_from_first_update(run):
    records = sorted(run.train_records, key=lambda r: r["iteration"])
    first = next(r["iteration"] for r in records if r["skipped_iterations"] < r["iteration"])
    losses = [run.losses[i] for i in range(first, records[-1]["iteration"] + 1)]
    assert first > 3 and losses[-1] < losses[0] - 0.1, (first, losses)


def test_fp16_resume_before_the_first_successful_step_is_bit_identical(tmp_path):
    """The checkpoints of the skipped iterations hold no optimizer state; a resume from one
    continues the uninterrupted run bit for bit."""
    args = [*ARGS, *FP16_WARM_UP]
    whole = train_in_process([*args, "--save-interval", "4", "--keep-last", "0"], tmp_path / "whole")
    meta = json.loads((whole.output_dir / "checkpoints" / "iter_0000004" / "run_meta.json").read_text())
    assert meta["has_optimizer_state"] is False
    resumed = train_in_process([*args, "--load", str(whole.output_dir / "checkpoints" / "iter_0000004")],
                               tmp_path / "resumed", after_load=check_main_weights)
    assert check_main_weights.checked == ["setup"]
    assert resumed.losses == {k: v for k, v in whole.losses.items() if k > 4}
    assert_learns_from_first_update(whole)


@pytest.mark.parametrize("precision,extra", [
    ("bf16", []),
    ("bf16", ["--epas-switch-mode", "checkpoint"]),
    ("fp16", FP16_UNIT_SCALE),
    ("bf16", ["--use-distributed-optimizer"]),
], ids=["bf16-memory", "bf16-checkpoint", "fp16-memory", "bf16-distributed-optimizer"])
def test_switch_before_the_first_step_reaches_the_main_weights(fp32_switches, tmp_path, precision, extra):
    run = train_in_process([*ARGS, *EARLY_SWITCHES, "--precision", precision, *extra], tmp_path / "run",
                           after_load=check_main_weights)
    assert [s["iteration"] for s in run.switches] == [1, 3]
    assert check_main_weights.checked == ["switch"]  # the switch at 1; the one at 3 carries optimizer state
    assert_follows(run, fp32_switches, precision)
    assert_learns(run)


def test_fp16_switches_inside_the_loss_scale_warm_up_learn(tmp_path):
    """The reported failure: switches while every step so far overflowed (no optimizer state)."""
    run = train_in_process([*ARGS, *EARLY_SWITCHES, *FP16_WARM_UP], tmp_path / "run", after_load=check_main_weights)
    assert [s["iteration"] for s in run.switches] == [1, 3]
    assert check_main_weights.checked == ["switch", "switch"]  # both before the first update
    assert_learns_from_first_update(run)


@pytest.mark.distributed
def test_pp2_and_dp2_loads_reach_the_main_weights(base, fp32_pretrained, fp32_switches, tmp_path):
    """PP=2 (plain optimizer) and DP=2 (distributed optimizer, main weights sharded): the same
    loads under torchrun, one launch; every rank checks its own main weights."""
    proc = run_script(REPO / "tests" / "training" / "scripts" / "precision_loads.py", [str(base), str(tmp_path)], nproc=2)
    cases = {case["name"]: case for case in json_lines(proc.stdout, "CASE")}
    assert set(cases) == {"pp2-pretrained", "pp2-switch-checkpoint", "dp2-pretrained", "dp2-switch"}
    for name, case in cases.items():
        assert case["checked"] == (["setup"] if "pretrained" in name else ["switch"]), name
        reference = fp32_pretrained if "pretrained" in name else fp32_switches
        losses = {int(k): v for k, v in case["losses"].items()}
        assert losses.keys() == reference.losses.keys(), name
        for iteration, loss in reference.losses.items():
            assert abs(losses[iteration] - loss) <= TOLERANCE["bf16"] * loss, (name, iteration, losses[iteration], loss)
        assert losses[10] < losses[1] - 0.1, (name, losses)
