"""Checkpoints that fail loudly and recover: a damaged checkpoint (truncated or missing data file,
unreadable or incomplete run_meta.json, missing DCP index) is a one-line error naming the file,
before any process group or data work; --load-fallback resumes from the newest whole checkpoint
and the run continues exactly as the uninterrupted one; --load naming nothing is an error except
for the run's own checkpoint directory (a first start)."""

import json
import shutil

import pytest
import torch.distributed as dist

from epas_megatron.checkpointing.checkpoint import latest_iteration, prune
from epas_megatron.checkpointing.integrity import checkpoint_problem, newest_sound_checkpoint, open_checkpoint
from epas_megatron.errors import ConfigError
from epas_megatron.train import main
from epas_testing import TINY, run_trainer

ARGS = [*TINY, "--train-iters", "6", "--global-batch-size", "4", "--micro-batch-size", "2", "--save-interval", "2",
        "--keep-last", "0", "--epas-target-layers", "2", "--epas-interval", "2", "--seed", "9"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An uninterrupted run with checkpoints at 2, 4 and 6."""
    return run_trainer(ARGS, tmp_path_factory.mktemp("integrity") / "run")


@pytest.fixture
def copy(trained, tmp_path):
    """A copy of the run directory to damage."""
    target = tmp_path / "run"
    shutil.copytree(trained.output_dir, target)
    return target


def data_file(checkpoint):
    return sorted(checkpoint.glob("*.distcp"))[0]


def test_a_whole_checkpoint_has_no_problem(trained):
    for iteration in (2, 4, 6):
        assert checkpoint_problem(trained.output_dir / "checkpoints" / f"iter_{iteration:07d}") is None


@pytest.mark.parametrize("damage, expected", [
    (lambda c: data_file(c).write_bytes(data_file(c).read_bytes()[:100]), "is truncated (100 bytes, the index reads up to byte"),
    (lambda c: data_file(c).unlink(), ".distcp is missing"),
    (lambda c: (c / ".metadata").unlink(), ".metadata is missing"),
    (lambda c: (c / ".metadata").write_bytes(b"not a pickle"), ".metadata cannot be read"),
    (lambda c: (c / "run_meta.json").write_text("{\"iteration\": 6"), "run_meta.json is not valid JSON"),
    (lambda c: (c / "run_meta.json").write_text("{}"), "run_meta.json lacks iteration, model"),
], ids=["truncated", "data_missing", "index_missing", "index_garbage", "meta_not_json", "meta_keys"])
def test_each_kind_of_damage_is_named(copy, damage, expected):
    checkpoint = copy / "checkpoints" / "iter_0000006"
    damage(checkpoint)
    assert expected in checkpoint_problem(checkpoint)
    with pytest.raises(ConfigError) as error:
        open_checkpoint(copy / "checkpoints", "--load")
    assert "checkpoint iter_0000006 is damaged: " in str(error.value) and expected in str(error.value)
    found, skipped = newest_sound_checkpoint(copy / "checkpoints", 6)
    assert found.name == "iter_0000004" and len(skipped) == 1 and skipped[0].startswith("iter_0000006: ")


def resume(copy, capsys, *extra):
    code = main([*ARGS, "--output-dir", str(copy), "--load", str(copy / "checkpoints"), *extra])
    return code, capsys.readouterr()


def test_resuming_a_damaged_checkpoint_is_an_error_before_any_work(copy, capsys):
    data = data_file(copy / "checkpoints" / "iter_0000006")
    data.write_bytes(data.read_bytes()[:100])
    code, captured = resume(copy, capsys)
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, captured.err
    assert f"checkpoint iter_0000006 is damaged: {data} is truncated" in errors[0] and "--load-fallback" in errors[0]
    assert "Traceback" not in captured.err and not dist.is_initialized()


def test_load_fallback_resumes_from_the_newest_whole_checkpoint_exactly(copy, trained, capsys, tmp_path):
    # Damage 6 and 4: the run must go back to 2, say so, and continue as the uninterrupted run.
    for iteration in (6, 4):
        data = data_file(copy / "checkpoints" / f"iter_{iteration:07d}")
        data.write_bytes(data.read_bytes()[:100])
    resumed = run_trainer([*ARGS, "--load", str(copy / "checkpoints"), "--load-fallback"], copy)
    assert "--load-fallback: skipped iter_0000006: " in resumed.stdout and "--load-fallback: skipped iter_0000004: " in resumed.stdout
    assert f"--load-fallback: resuming from {copy / 'checkpoints' / 'iter_0000002'} instead" in resumed.stdout
    later = {i: loss for i, loss in resumed.losses.items() if i > 2}
    assert sorted(later) == [3, 4, 5, 6]
    assert later == {i: trained.losses[i] for i in later}  # bit-identical to the uninterrupted run
    # The damaged ones were replaced by the new saves; every checkpoint is whole again.
    assert latest_iteration(copy / "checkpoints") == 6
    assert all(checkpoint_problem(copy / "checkpoints" / f"iter_{i:07d}") is None for i in (2, 4, 6))


def test_load_fallback_with_no_whole_checkpoint_is_an_error(copy, capsys):
    for iteration in (2, 4, 6):
        (copy / "checkpoints" / f"iter_{iteration:07d}" / ".metadata").unlink()
    code, captured = resume(copy, capsys, "--load-fallback")
    assert code == 2 and "no checkpoint in" in captured.err and "is whole" in captured.err


def test_load_of_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    code = main([*TINY, "--output-dir", str(out), "--load", str(tmp_path / "nope")])
    assert code == 2 and f"error: --load {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    code = main([*TINY, "--output-dir", str(out), "--load", str(tmp_path / "empty")])
    assert code == 2 and "no checkpoint there" in capsys.readouterr().err
    code = main([*TINY, "--output-dir", str(out), "--load-fallback"])
    assert code == 2 and "--load-fallback applies to --load" in capsys.readouterr().err
    assert not out.exists()


def test_the_runs_own_checkpoint_directory_on_a_first_start_trains_from_scratch(tmp_path):
    out = tmp_path / "run"
    run = run_trainer([*TINY, "--train-iters", "2", "--load", str(out / "checkpoints")], out)
    assert "no checkpoint there yet (the run's own checkpoint directory); starting from scratch" in run.stdout
    assert run.summary["iterations"] == 2


def test_pipeline_layout_with_one_stage_is_an_error(tmp_path, capsys):
    code = main([*TINY, "--output-dir", str(tmp_path / "out"), "--pipeline-layout", "Ett|ttL"])
    err = capsys.readouterr().err
    assert code == 2 and "error: --pipeline-layout 'Ett|ttL' splits layers over pipeline stages and needs --pp >= 2" in err
    assert "Traceback" not in err


def test_epas_eval_refuses_a_damaged_checkpoint(copy, capsys):
    from epas_megatron.evaluate import main as epas_eval

    (copy / "checkpoints" / "iter_0000006" / "run_meta.json").write_text("{}")
    code = epas_eval(["--load", str(copy / "checkpoints"), "--regions", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "run_meta.json lacks iteration, model" in err and "Traceback" not in err


def test_prune_leaves_checkpoints_newer_than_the_latest_alone(copy):
    root = copy / "checkpoints"
    (root / "latest_checkpointed_iteration.txt").write_text("4")  # as after falling back past 6
    prune(root, keep_last=1)
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000004", "iter_0000006"]
    meta = json.loads((root / "iter_0000004" / "run_meta.json").read_text())
    assert meta["iteration"] == 4
