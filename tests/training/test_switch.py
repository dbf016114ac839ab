"""The switch event: frozen Q/K never move, the loss right after a switch equals a model built
directly with the new region, optimizer state is carried exactly, frozen weights are outside the
optimizer and the gradient buffers."""

import torch

from epas_megatron.config.cli import parse_config
from epas_megatron.model.attention import SharedAttention, split_qkv_rows
from epas_megatron.validation import resolve_run
from epas_testing import TINY

# Switches at 3 (region [3]), 6 ([2, 3]) and 9 ([1, 2, 3]).
ARGS = [*TINY, "--train-iters", "12", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--epas-target-layers", "3", "--epas-interval", "3", "--seed", "5", "--init-method-std", "0.1",
        "--weight-decay", "0.5"]


def trainer_for(argv):
    from epas_megatron.training.trainer import Trainer

    trainer = Trainer(resolve_run(parse_config(argv), world_size=1))
    trainer.setup()
    return trainer


def layer(trainer, index):
    from epas_megatron.runtime.wrapping import unwrap_model

    return unwrap_model(trainer.model[0]).decoder.layers[index]


def optimizer_state(trainer, param):
    torch_optimizer = trainer.optimizer.chained_optimizers[0].optimizer
    return torch_optimizer.state.get(param)


def optimizer_params(trainer):
    return {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}


def ddp_params(trainer):
    return {id(p) for chunk in trainer.model for p in chunk.param_to_bucket_group}


def test_switch_carries_state_exactly_and_freezes_qk(tmp_path):
    out = tmp_path / "run"
    # Train to iteration 5 (region [3]) and look at layer 2 while it still computes.
    trainer = trainer_for([*ARGS, "--exit-interval", "5", "--output-dir", str(out)])
    try:
        trainer.train()
        before = {name: (p.detach().clone(), {k: v.clone() for k, v in (optimizer_state(trainer, p) or {}).items() if torch.is_tensor(v)})
                  for name, p in trainer.model[0].module.named_parameters()}
    finally:
        trainer.close()

    trainer = trainer_for([*ARGS, "--load", str(out / "checkpoints"), "--output-dir", str(out)])
    try:
        assert trainer.sharing_layers == (3,)
        trainer.apply_switch((2, 3))  # what train() does before the step of iteration 6
        attention = layer(trainer, 2).self_attention
        assert isinstance(attention, SharedAttention)
        # V rows (and their Adam moments) of layer 2's fused QKV became linear_v; Q/K rows are frozen.
        parts = split_qkv_rows(before["decoder.layers.2.self_attention.linear_qkv.weight"][0], ("q", "k", "v"), 2, 2, 16)
        assert torch.equal(attention.linear_v.weight, parts["v"])
        assert torch.equal(attention.linear_qk.weight, torch.cat([parts["q"].view(2, 32, 64), parts["k"].view(2, 16, 64)], 1).view(-1, 64))
        state = optimizer_state(trainer, attention.linear_v.weight)
        for key in ("exp_avg", "exp_avg_sq"):
            saved = split_qkv_rows(before["decoder.layers.2.self_attention.linear_qkv.weight"][1][key], ("q", "k", "v"), 2, 2, 16)
            assert torch.equal(state[key], saved["v"]), key
        # Every other parameter and its optimizer state is carried bit for bit.
        for name, param in trainer.model[0].module.named_parameters():
            if "layers.2.self_attention.linear_" in name and "proj" not in name:
                continue
            weight, moments = before[name]
            assert torch.equal(param, weight), name
            for key, value in moments.items():
                assert torch.equal(optimizer_state(trainer, param)[key], value), (name, key)
        # Frozen weights: no gradient, no optimizer state, not in any optimizer group or DDP bucket.
        frozen = [p for p in trainer.model[0].module.parameters() if not p.requires_grad]
        assert len(frozen) == 2  # layers 2 and 3
        assert not {id(p) for p in frozen} & optimizer_params(trainer)
        assert not {id(p) for p in frozen} & ddp_params(trainer)
        assert all(optimizer_state(trainer, p) is None for p in frozen)

        frozen_at_switch = {i: layer(trainer, i).self_attention.linear_qk.weight.detach().clone() for i in (2, 3)}
        summary = trainer.train()  # iterations 6..12, with another switch at 9 (weight decay 0.5)
        assert summary["iterations"] == 12
        for i in (2, 3):
            assert torch.equal(layer(trainer, i).self_attention.linear_qk.weight, frozen_at_switch[i]), i
            assert layer(trainer, i).self_attention.linear_qk.weight.grad is None
        assert layer(trainer, 1).self_attention.linear_qk.weight.requires_grad is False
    finally:
        trainer.close()


def test_loss_right_after_a_switch_equals_a_model_built_with_that_region(tmp_path):
    """Iteration 6's training loss (first step with region [2, 3]) equals the forward loss of a
    model built directly with region [2, 3] and loaded from the iteration-5 weights."""
    from epas_megatron.checkpointing.checkpoint import iteration_dir, load_checkpoint
    from epas_megatron.data.datasets import build_data_iterator
    from epas_megatron.engine.step import loss_func
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model

    out = tmp_path / "run"
    trainer = trainer_for([*ARGS, "--exit-interval", "6", "--save-interval", "5", "--output-dir", str(out)])
    try:
        trainer.train()
        import json

        records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
        loss_6 = next(r["lm_loss"] for r in records if r.get("iteration") == 6 and "kind" not in r)

        arch = trainer.plan.arch
        direct = build_model(BuildPlan.for_region(arch, (2, 3))).chunks[0]
        load_checkpoint(iteration_dir(out / "checkpoints", 5), [direct], restore_rng=False)
        batches = build_data_iterator(trainer.data.train_ds, 2, 0, 1, consumed_samples=5 * 4)
        total, tokens = 0.0, 0.0
        with torch.no_grad():
            for _ in range(2):  # the two micro-batches of iteration 6
                batch = next(batches)
                out_tensor = direct(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                loss_sum, _, reported = loss_func(batch["loss_mask"], out_tensor)
                total += float(reported["lm loss"][0])
                tokens += float(reported["lm loss"][1])
        assert abs(total / tokens - loss_6) <= 1e-6 * abs(loss_6)
    finally:
        trainer.close()
