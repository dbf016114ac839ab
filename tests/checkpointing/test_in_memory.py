"""The in-memory switch's transfer plan (pure) and its state hand-over in one process against a
checkpoint save + load of the same objects."""

import pytest
import torch

from epas_megatron.checkpointing.in_memory import _plan_transfers

SHAPE = ((4, 8), "torch.float32")


def test_plan_sends_each_needed_shard_from_its_main_replica():
    a, b, c = ("layers.w", (0,), None), ("layers.w", (1,), None), ("optimizer.state.exp_avg.layers.w", (1,), None)
    gathered = [
        {"main": {a: SHAPE, b: SHAPE}, "needs": []},
        {"main": {c: SHAPE}, "needs": [(b, SHAPE)]},
        {"main": {}, "needs": [(a, SHAPE), (c, SHAPE)]},
    ]
    assert _plan_transfers(gathered) == [(0, 1, b), (0, 2, a), (1, 2, c)]


def test_plan_names_a_shard_nobody_holds_and_a_shape_mismatch():
    a = ("decoder.layers.self_attention.linear_v.weight", (3, 0, 0), None)
    with pytest.raises(RuntimeError, match="rank 1 needs decoder.layers.self_attention.linear_v.weight.*--epas-switch-mode checkpoint"):
        _plan_transfers([{"main": {}, "needs": []}, {"main": {}, "needs": [(a, SHAPE)]}])
    with pytest.raises(RuntimeError, match=r"linear_v.weight is \(\(2, 8\), 'torch.float32'\) on rank 0"):
        _plan_transfers([{"main": {a: ((2, 8), "torch.float32")}, "needs": []}, {"main": {}, "needs": [(a, SHAPE)]}])


def test_held_state_restores_what_a_checkpoint_load_restores(tmp_path):
    """Train past the first switch, then move the state into the next region's objects both
    ways: weights, frozen Q/K and every optimizer tensor are equal, and the next step's loss too."""
    from epas_megatron.checkpointing.in_memory import hold_state
    from epas_megatron.checkpointing.switch_adoption import restore_state
    from epas_megatron.config.cli import parse_config
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run
    from epas_testing import TINY

    argv = [*TINY, "--train-iters", "4", "--exit-interval", "3", "--global-batch-size", "2", "--micro-batch-size", "1",
            "--epas-target-layers", "2", "--epas-interval", "2", "--seed", "3", "--output-dir", str(tmp_path / "run"), "--no-save-final"]
    trainer = Trainer(resolve_run(parse_config(argv), world_size=1))
    trainer.setup()
    try:
        trainer.train()  # region [3] from iteration 2
        saved = trainer.save(root=tmp_path / "staging", keep_last=0)
        held = hold_state(trainer.model, trainer.optimizer, trainer.scheduler, {})
        trainer.plan = trainer._plan_for((2, 3))

        def state_of(t):
            model = {k: v.clone() for k, v in t.model[0].module.state_dict().items() if torch.is_tensor(v)}
            optim = t.optimizer.state_dict()
            moments = {(i, k): v.clone() for i, s in optim["state"].items() for k, v in s.items() if torch.is_tensor(v)}
            return model, moments, t.scheduler.state_dict()

        trainer.build(initialize=True)  # different values everywhere before the load
        trainer.load(saved)
        by_checkpoint = state_of(trainer)
        trainer.build(initialize=True)
        stats = restore_state(held, trainer.model, trainer.optimizer, trainer.scheduler)
        by_memory = state_of(trainer)
        assert stats.tensors_received == 0 and stats.tensors_local > 0
        assert by_memory[0].keys() == by_checkpoint[0].keys()
        assert any("linear_v" in k for k in by_memory[0]) and any("linear_qk" in k for k in by_memory[0])
        for key, value in by_checkpoint[0].items():
            assert torch.equal(by_memory[0][key], value), key
        assert by_memory[1].keys() == by_checkpoint[1].keys() and len(by_memory[1]) > 0
        for key, value in by_checkpoint[1].items():
            assert torch.equal(by_memory[1][key], value), key
        assert by_memory[2] == by_checkpoint[2]
    finally:
        trainer.close()


@pytest.mark.parametrize("mode", ["memory", "checkpoint"])
def test_distributed_optimizer_state_is_never_gathered_by_the_in_memory_switch(tmp_path, monkeypatch, mode):
    """The in-memory switch moves the distributed optimizer's own shards; only the checkpoint
    round trip gathers them over DP into model space (Megatron's get_parameter_state_dp_zero,
    made to fail here: the checkpoint mode shows the trap works)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from epas_megatron.config.cli import parse_config
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run
    from epas_testing import TINY

    def gather(*args, **kwargs):
        raise AssertionError("optimizer state gathered over DP")

    monkeypatch.setattr(DistributedOptimizer, "get_parameter_state_dp_zero", gather)
    argv = [*TINY, "--train-iters", "4", "--global-batch-size", "2", "--micro-batch-size", "1", "--epas-target-layers", "2",
            "--epas-interval", "2", "--seed", "3", "--output-dir", str(tmp_path / "run"), "--no-save-final",
            "--use-distributed-optimizer", "--epas-switch-mode", mode]
    trainer = Trainer(resolve_run(parse_config(argv), world_size=1))
    trainer.setup()
    try:
        trainer._train_step()  # optimizer state exists
        if mode == "checkpoint":
            with pytest.raises(AssertionError, match="gathered over DP"):
                trainer.apply_switch((3,))
        else:
            trainer.apply_switch((3,))
            trainer._train_step()
            assert trainer.sharing_layers == (3,)
    finally:
        trainer.close()


def test_range_plan_covers_each_wanted_range_once_from_its_owners():
    from epas_megatron.checkpointing.distributed_shards import _range_transfers

    w, e = (("tensor", ("decoder.layers.mlp.linear_fc2.weight", (0, 0, 0), None)),
            ("tensor", ("embedding.word_embeddings.weight", (0, 0), None)))
    gathered = [
        {"holds": {w: (100, 0, 60), e: (50, 0, 50)}},  # rank 0 owned elements 0-60 of w
        {"holds": {w: (100, 60, 100), e: (50, 0, 50)}},  # rank 1 the rest; e replicated (tied) on both
    ]
    # After the switch the DP boundary moved to 40: rank 1 wants 40-100, rank 0 wants 0-40.
    plan = _range_transfers(gathered, [(0, w, 0, 40), (1, w, 40, 100), (1, e, 0, 50)])
    assert sorted(plan) == sorted([(0, 0, w, 0, 40), (0, 1, w, 40, 60), (1, 1, w, 60, 100), (1, 1, e, 0, 50)])
    with pytest.raises(RuntimeError, match="elements 100-120 of decoder.layers.mlp.linear_fc2.weight are held by no rank"):
        _range_transfers(gathered, [(0, w, 90, 120)])
