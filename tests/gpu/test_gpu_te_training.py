"""Switches and frozen rows with Transformer Engine layers (skipped where TE does not import; issue
#42 item 3). Written 2026-11-28, **not yet run on a GPU**; the trainer runs in this process (no
``world`` fixture here: it makes its own one-GPU NCCL world), bf16, the tiny preset:

* the in-memory switch hands over what a checkpoint save and load would, with TE layers: train
  past a switch, then move the state into the next region's freshly built TE objects both ways --
  the bf16 weights (TE's fused norm weights and extra state among them), the frozen Q/K rows, the
  distributed optimizer's fp32 main shards and Adam moments, the LR schedule -- bit for bit (the
  CPU suite's tests/checkpointing/test_in_memory.py, with local layers). Control: the fresh build
  they are moved into differs from both.
* whole runs with ``--epas-switch-mode memory`` and ``checkpoint`` (``--deterministic``: TE's
  deterministic attention) give the same losses and gradient norms through two switches, bit for
  bit. Control: a run whose first switch comes one iteration later equals them bit for bit before
  their first switch (so the kernels are deterministic and equality is a fair test) and differs at
  it (so a switch shows).
* the frozen-rows audit (tests/frozen_check.py) with TE layers, ``kv`` sharing and Megatron's
  mixed-precision optimizer (the TE case of test_gpu_frozen_qk.py has ``qk`` and the distributed
  one). Control: a planted fault -- the rows frozen only after the optimizer and the DDP buckets
  were built, the classic ordering bug -- is seen by each part of the audit (in the optimizer, in
  a bucket, with a gradient, moved by weight decay).
"""

import pytest
import torch

from epas_megatron.model.fusions import transformer_engine_importable
from epas_testing import TINY, run_trainer
from frozen_check import ARGS as AUDIT_ARGS
from frozen_check import assert_frozen, run_audited

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not transformer_engine_importable(),
                       reason="Transformer Engine is not installed on this node (pip install -r requirements-gpu.txt)"),
]

TE = ["--transformer-impl", "transformer_engine"]


# ------------------------------------------------------------------ the in-memory hand-over against a checkpoint's
def _model_tensors(trainer) -> dict[str, torch.Tensor]:
    """The model chunks' state-dict tensors (TE's fused norm weights and ``_extra_state`` included)."""
    from epas_megatron.runtime.wrapping import unwrap_model

    return {f"{i}.{k}": v.detach().clone() for i, chunk in enumerate(trainer.model)
            for k, v in unwrap_model(chunk).state_dict().items() if torch.is_tensor(v)}


def _optimizer_tensors(optimizer) -> dict[tuple, torch.Tensor]:
    """What the optimizer steps with, by position: the (fp32 main, sharded) parameters it updates
    and every tensor of their state (Adam's moments, a step count), read off the inner optimizer
    of each part (a distributed optimizer's own shards, never gathered)."""
    found = {}
    for i, part in enumerate(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        inner = getattr(part, "optimizer", part)
        for g, group in enumerate(inner.param_groups):
            for j, param in enumerate(group["params"]):
                found[(i, g, j, "param")] = param.detach().clone()
                for key, value in inner.state.get(param, {}).items():
                    if torch.is_tensor(value):
                        found[(i, g, j, key)] = value.detach().clone()
    return found


def _state_of(trainer):
    return _model_tensors(trainer), _optimizer_tensors(trainer.optimizer), trainer.scheduler.state_dict()


def _unequal(a: dict, b: dict) -> list:
    return sorted(str(k) for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def test_te_in_memory_hand_over_equals_a_checkpoint_load(tmp_path):
    """Train 3 iterations (region [3] from iteration 2, TE layers, the distributed optimizer), save,
    hold the state in memory; rebuild for region [2, 3] (fresh TE objects, initialised afresh) and
    load the checkpoint; rebuild again and restore the held state: the two are equal tensor for
    tensor. About 6 s."""
    from epas_megatron.checkpointing.in_memory import hold_state
    from epas_megatron.checkpointing.switch_adoption import restore_state
    from epas_megatron.config.cli import parse_config
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    argv = [*TINY, *TE, "--train-iters", "4", "--exit-interval", "3", "--global-batch-size", "2", "--micro-batch-size", "1",
            "--epas-target-layers", "2", "--epas-interval", "2", "--seed", "3", "--use-distributed-optimizer",
            "--output-dir", str(tmp_path / "run"), "--no-save-final"]
    trainer = Trainer(resolve_run(parse_config(argv), world_size=1))
    trainer.setup()
    try:
        assert trainer.run.backend == "transformer_engine" and trainer.run.precision == "bf16", trainer.run
        trainer.train()  # region [3] from iteration 2
        saved = trainer.save(root=tmp_path / "staging", keep_last=0)
        held = hold_state(trainer.model, trainer.optimizer, trainer.scheduler, {})
        trainer.plan = trainer._plan_for((2, 3))

        trainer.build(initialize=True)
        fresh = _state_of(trainer)
        trainer.load(saved)
        by_checkpoint = _state_of(trainer)
        trainer.build(initialize=True)
        stats = restore_state(held, trainer.model, trainer.optimizer, trainer.scheduler)
        by_memory = _state_of(trainer)
    finally:
        trainer.close()
    keys = by_checkpoint[0].keys()
    assert any("layer_norm_weight" in k for k in keys) and any("linear_v" in k for k in keys) and any("linear_qk" in k for k in keys)
    assert stats.tensors_local > 0 and stats.tensors_received == 0, stats
    assert _unequal(by_memory[0], by_checkpoint[0]) == [], "model tensors differ"
    assert len(by_checkpoint[1]) > len({k[:3] for k in by_checkpoint[1]}), "no optimizer state was carried"
    assert _unequal(by_memory[1], by_checkpoint[1]) == [], "optimizer tensors differ"
    assert by_memory[2] == by_checkpoint[2]
    # The control: the fresh build both were moved into is neither (trained weights, Adam's state).
    assert _unequal(fresh[0], by_checkpoint[0]) and _unequal(fresh[1], by_checkpoint[1])
    print(f"TE hand-over: {len(by_checkpoint[0])} model and {len(by_checkpoint[1])} optimizer tensors equal; "
          f"{len(_unequal(fresh[0], by_checkpoint[0]))} model tensors differ in the fresh build")


# ------------------------------------------------------------------ whole runs: memory switch == checkpoint switch
# 4 layers, switches at 3 ([3]) and 6 ([2, 3]); the control's at 4 and 7.
SWITCH_ARGS = [*TINY, *TE, "--train-iters", "8", "--global-batch-size", "8", "--micro-batch-size", "4",
               "--epas-target-layers", "2", "--epas-interval", "3", "--seed", "3", "--init-method-std", "0.1",
               "--lr", "3e-3", "--lr-warmup-iters", "3", "--deterministic", "--no-save-final"]


def test_te_memory_and_checkpoint_switches_give_the_same_run(tmp_path):
    """bf16, TE layers, Megatron's mixed-precision optimizer and then the distributed one: the
    in-memory switch (CUDA tensors, NCCL collectives of a one-GPU world) and the staging
    checkpoint's give the same losses and gradient norms, bit for bit. Control (the first pair):
    a run switching first at iteration 4 equals them before the first switch (iterations 1 and 2)
    and differs at iteration 3. About 20 s (five 8-iteration runs)."""
    for extra in (["--no-use-distributed-optimizer"], ["--use-distributed-optimizer"]):
        name = extra[0].lstrip("-")
        memory = run_trainer([*SWITCH_ARGS, *extra, "--epas-switch-mode", "memory"], tmp_path / f"memory-{name}")
        staged = run_trainer([*SWITCH_ARGS, *extra, "--epas-switch-mode", "checkpoint"], tmp_path / f"staged-{name}")
        assert "transformer_engine layers" in memory.stdout and "CUDA" in memory.stdout.splitlines()[0]
        assert [(s["iteration"], s["switch_mode"]) for s in memory.switches] == [(3, "memory"), (6, "memory")]
        assert [(s["iteration"], s["switch_mode"]) for s in staged.switches] == [(3, "checkpoint"), (6, "checkpoint")]
        assert memory.losses == staged.losses and memory.grad_norms == staged.grad_norms, extra
        if extra == ["--no-use-distributed-optimizer"]:
            later = run_trainer([*SWITCH_ARGS, *extra, "--epas-first-switch", "4"], tmp_path / "later")
            assert [s["iteration"] for s in later.switches] == [4, 7]
            # A switch at iteration n comes before step n: the runs share iterations 1 and 2.
            assert all(later.losses[i] == memory.losses[i] for i in (1, 2)), (later.losses, memory.losses)
            assert later.losses[3] != memory.losses[3], (later.losses, memory.losses)
    print(f"TE switch modes agree; losses {memory.losses}")


# ------------------------------------------------------------------ the frozen-rows audit, kv, mixed-precision optimizer
EXPECTED_FROZEN = [f"0.decoder.layers.{i}.self_attention.linear_kv.weight" for i in (1, 2, 3)]


def test_te_frozen_kv_rows_stay_out_of_the_mixed_precision_optimizer(tmp_path, monkeypatch):
    """The audit with TE layers, ``--epas-share kv`` and ``--no-use-distributed-optimizer`` (bf16
    weights, fp32 main copies), switches at 3, 6 and 9 of 12 iterations, weight decay 0.5. Then
    the planted fault: the sharing layers' K/V rows built trainable and frozen only after the
    optimizer and the DDP buckets were made -- the audit must see them in the optimizer, in a
    bucket, with a gradient buffer and moved by weight decay, and fail. About 12 s (two runs)."""
    from epas_megatron.engine import state as state_module
    from epas_megatron.model.attention import FrozenProjection

    args = [*AUDIT_ARGS, *TE, "--no-use-distributed-optimizer", "--epas-share", "kv"]
    record = run_audited(args, tmp_path / "run")
    (banner,) = [line for line in record["stdout"].splitlines() if line.startswith("epas-megatron: ")]
    assert "CUDA" in banner and "| bf16, " in banner and " transformer_engine layers" in banner, banner
    assert ", distributed optimizer" not in banner, banner
    assert_frozen(record, "linear_kv")

    build, construct = state_module.build_training_state, FrozenProjection.__init__

    def trainable(self, *args, **kwargs):
        construct(self, *args, **kwargs)
        self.weight.requires_grad_(True)

    def frozen_too_late(plan, settings=None, seed=None):
        built = build(plan, settings, seed)
        for chunk in built.model:
            for module in chunk.modules():
                if isinstance(module, FrozenProjection):
                    module.weight.requires_grad_(False)
        return built

    monkeypatch.setattr(FrozenProjection, "__init__", trainable)
    monkeypatch.setattr(state_module, "build_training_state", frozen_too_late)
    planted = run_audited(args, tmp_path / "planted")
    with pytest.raises(AssertionError):
        assert_frozen(planted, "linear_kv")
    end = planted["end"]
    assert end["frozen"] == end["frozen_in_optimizer"] == end["frozen_in_buckets"] == end["frozen_with_grad"] == EXPECTED_FROZEN, end
    assert planted["moved_frozen"] == EXPECTED_FROZEN, planted["moved_frozen"]
