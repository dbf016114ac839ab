"""Frozen Q/K rows after a switch, audited in a real training run (the trainer in this process):
a sharing layer's frozen projection (``linear_qk``; ``linear_kv`` with ``--epas-share kv``, a
:class:`~epas_megatron.model.attention.FrozenProjection`) must be in no optimizer group --
whatever the optimizer: fp32 (it steps the model's weights), Megatron's mixed-precision one (bf16
weights and their fp32 main copies), the distributed optimizer (shards of both) -- in no DDP
bucket, have no gradient, and be bit-unchanged from its switch to the end of the run, through
optimizer steps with weight decay on and later switches. The trainable parameters are the
controls: every one of them is in the optimizer and in a bucket, and those of the sharing layers
move after the switch (so steps happen, and show in the run's precision).

The GPU suite runs it in bf16 with the distributed and the mixed-precision optimizer, local and
Transformer Engine layers (tests/gpu/test_gpu_frozen_qk.py); the CPU suite in fp32 and bf16
(tests/training/test_frozen_audit.py). CPU equivalents by other means: training/test_switch.py
(fp32, the switch in detail), distributed/test_frozen_weights.py (DP=2, overlapped reduction).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Sequence

import torch

from epas_testing import TINY

# 4 layers; switches at 3 ([3]), 6 ([2, 3]) and 9 ([1, 2, 3]). Weight decay 0.5 at a constant
# learning rate of 3e-3: a weight wrongly left to the optimizer would shrink by 0.15 % a step
# (decoupled decay, even with a zero gradient), past bf16's half-ulp (0.4 %) within 3 steps, the
# fewest any frozen weight here sees (layer 1, iterations 10-12).
ARGS = [*TINY, "--train-iters", "12", "--global-batch-size", "4", "--micro-batch-size", "2", "--epas-target-layers", "3",
        "--epas-interval", "3", "--seed", "5", "--init-method-std", "0.1", "--lr", "3e-3", "--lr-warmup-iters", "2",
        "--lr-decay-style", "constant", "--weight-decay", "0.5", "--no-save-final"]


def optimizer_model_params(optimizer) -> set[int]:
    """ids of the model parameters ``optimizer`` updates, from Megatron's own fields: the
    distributed optimizer's ``model_float16_groups`` / ``model_fp32_groups``, the mixed-precision
    optimizer's ``float16_groups`` / ``fp32_from_fp32_groups``; an fp32 optimizer's param groups
    hold the model's parameters themselves."""
    ids = set()
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        fields = [f for f in ("model_float16_groups", "model_fp32_groups", "float16_groups", "fp32_from_fp32_groups")
                  if getattr(part, f, None) is not None]
        if fields:
            ids.update(id(p) for f in fields for group in getattr(part, f) for p in group)
        else:
            ids.update(id(p) for group in part.param_groups for p in group["params"])
    return ids


def _frozen_names(trainer) -> dict[str, torch.nn.Parameter]:
    from epas_megatron.runtime.wrapping import unwrap_model

    return {f"{i}.{name}": p for i, chunk in enumerate(trainer.model) for name, p in unwrap_model(chunk).named_parameters()
            if not p.requires_grad}


def audit(trainer) -> dict:
    """Where the frozen and the trainable parameters of ``trainer``'s model are now."""
    from epas_megatron.runtime.wrapping import unwrap_model

    in_optimizer = optimizer_model_params(trainer.optimizer)
    in_buckets = {id(p) for chunk in trainer.model for p in chunk.param_to_bucket_group}
    named = {f"{i}.{name}": p for i, chunk in enumerate(trainer.model) for name, p in unwrap_model(chunk).named_parameters()}
    frozen = {n: p for n, p in named.items() if not p.requires_grad}
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    return {
        "frozen": sorted(frozen),
        "frozen_in_optimizer": sorted(n for n, p in frozen.items() if id(p) in in_optimizer),
        "frozen_in_buckets": sorted(n for n, p in frozen.items() if id(p) in in_buckets),
        "frozen_with_grad": sorted(n for n, p in frozen.items() if p.grad is not None or getattr(p, "main_grad", None) is not None),
        "trainable_not_in_optimizer": sorted(n for n, p in trainable.items() if id(p) not in in_optimizer),
        "trainable_not_in_buckets": sorted(n for n, p in trainable.items() if id(p) not in in_buckets),
        "optimizer_params": len(in_optimizer),
        "trainable_params": len(trainable),
    }


def run_audited(args: Sequence[str], output_dir: Path) -> dict:
    """Train ``args`` in this process, auditing after every switch and at the end; returns
    {"switches": [(iteration-less) audits after each switch], "end": audit at the end,
    "moved_frozen": frozen weights that differ from their value at their switch,
    "unmoved_trainable": trainable weights of sharing layers equal to theirs at the last switch,
    "stdout": the run's output}."""
    from epas_megatron.config.cli import parse_config
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    trainer = Trainer(resolve_run(parse_config([*args, "--output-dir", str(output_dir)]), world_size=1))
    stdout = io.StringIO()
    record = {"switches": []}
    frozen_at_switch: dict[str, torch.Tensor] = {}
    sharing_at_last_switch: dict[str, torch.Tensor] = {}
    try:
        with contextlib.redirect_stdout(stdout):
            trainer.setup()
            apply_switch = trainer.apply_switch

            def audited_switch(sharing_layers):
                info = apply_switch(sharing_layers)
                record["switches"].append(audit(trainer))
                for name, param in _frozen_names(trainer).items():
                    frozen_at_switch.setdefault(name, param.detach().clone())
                sharing_at_last_switch.clear()
                for name, param in _sharing_layer_trainables(trainer).items():
                    sharing_at_last_switch[name] = param.detach().clone()
                return info

            trainer.apply_switch = audited_switch
            trainer.train()
            record["end"] = audit(trainer)
            frozen_now = _frozen_names(trainer)
            record["moved_frozen"] = sorted(n for n, p in frozen_now.items() if not torch.equal(p, frozen_at_switch[n]))
            record["frozen_since_switch"] = sorted(frozen_at_switch)
            trainables = _sharing_layer_trainables(trainer)
            record["unmoved_trainable"] = sorted(n for n, p in trainables.items() if torch.equal(p, sharing_at_last_switch[n]))
            record["sharing_trainables"] = sorted(trainables)
    finally:
        with contextlib.redirect_stdout(stdout):
            trainer.close()
        record["stdout"] = stdout.getvalue()
    return record


def _sharing_layer_trainables(trainer) -> dict[str, torch.nn.Parameter]:
    """Trainable weights of the sharing layers' attention (their own projection, linear_proj)."""
    from epas_megatron.model.attention import SharedAttention
    from epas_megatron.runtime.wrapping import unwrap_model

    found = {}
    for i, chunk in enumerate(trainer.model):
        for name, module in unwrap_model(chunk).named_modules():
            if isinstance(module, SharedAttention):
                for pname, p in module.named_parameters():
                    if p.requires_grad:
                        found[f"{i}.{name}.{pname}"] = p
    return found


def assert_frozen(record: dict, frozen_part: str = "linear_qk") -> None:
    """The audit of :func:`run_audited` for :data:`ARGS` (layers 3, 2, 1 switching at 3, 6, 9)."""
    expected = [f"0.decoder.layers.{i}.self_attention.{frozen_part}.weight" for i in (1, 2, 3)]
    assert [len(a["frozen"]) for a in record["switches"]] == [1, 2, 3], record["switches"]
    for audited in [*record["switches"], record["end"]]:
        assert audited["frozen_in_optimizer"] == [] and audited["frozen_in_buckets"] == [], audited
        assert audited["frozen_with_grad"] == [], audited
        # the controls: the optimizer and the buckets hold every trainable parameter, and only those
        assert audited["trainable_not_in_optimizer"] == [] and audited["trainable_not_in_buckets"] == [], audited
        assert audited["optimizer_params"] == audited["trainable_params"], audited
    assert record["end"]["frozen"] == expected, record["end"]
    assert record["frozen_since_switch"] == expected and record["moved_frozen"] == [], record
    assert record["sharing_trainables"] and record["unmoved_trainable"] == [], record
