"""Checkpoint files: the latest pointer is written last and atomically; pruning; metadata."""

import pytest
import torch

from epas_megatron.checkpointing import checkpoint as ckpt
from epas_megatron.engine.optimizer import OptimizerSettings, build_optimizer, build_scheduler, wrap_ddp
from epas_megatron.model.architecture import LlamaArchitecture
from epas_testing import build

pytestmark = pytest.mark.usefixtures("single_process")

ARCH = LlamaArchitecture(num_layers=2, hidden_size=32, num_attention_heads=2, num_query_groups=2,
                         ffn_hidden_size=64, vocab_size=128, max_sequence_length=16)
SETTINGS = OptimizerSettings(lr=1e-3, min_lr=1e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                             clip_grad=1.0, use_distributed_optimizer=False, overlap_grad_reduce=False,
                             warmup_iters=1, decay_iters=10, decay_style="cosine")


def training_state(seed):
    """Model, optimizer (after one step, so it has Adam state) and scheduler."""
    from epas_megatron.engine.step import train_step

    model = build(ARCH, seed=seed)
    wrapped = wrap_ddp([model], model.config, SETTINGS)
    optimizer = build_optimizer(wrapped, SETTINGS)
    scheduler = build_scheduler(optimizer, SETTINGS)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 16), "position_ids": torch.arange(16).expand(2, -1)}
    train_step(wrapped, optimizer, scheduler, [iter([batch])], num_microbatches=1, seq_length=16, micro_batch_size=2)
    return wrapped, optimizer, scheduler


def weights(chunks):
    return {k: v.clone() for k, v in chunks[0].module.state_dict().items() if torch.is_tensor(v)}


def test_crash_during_save_never_moves_the_pointer(tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    root = tmp_path / "ckpts"
    chunks, optimizer, scheduler = training_state(seed=1)
    ckpt.save_checkpoint(root, 1, chunks, optimizer, scheduler, {"iteration": 1}, {"iteration": 1})
    assert ckpt.latest_iteration(root) == 1

    real_save = dist_checkpointing.save

    def crashing_save(state, directory, *args, **kwargs):
        (torch.save({"half": torch.zeros(3)}, f"{directory}/__0_0.distcp"))
        raise RuntimeError("node lost power")

    monkeypatch.setattr(dist_checkpointing, "save", crashing_save)
    with pytest.raises(RuntimeError, match="power"):
        ckpt.save_checkpoint(root, 2, chunks, optimizer, scheduler, {"iteration": 2}, {})
    assert ckpt.latest_iteration(root) == 1
    assert (root / "iter_0000002").exists() and not (root / "iter_0000002" / ckpt.META).exists()
    assert ckpt.resolve_checkpoint(root) == root / "iter_0000001"

    monkeypatch.setattr(dist_checkpointing, "save", real_save)
    expected = weights(chunks)
    ckpt.save_checkpoint(root, 2, chunks, optimizer, scheduler, {"iteration": 2}, {"note": "second"})
    assert ckpt.latest_iteration(root) == 2
    assert ckpt.read_meta(ckpt.resolve_checkpoint(root), required=()) == {"note": "second", "iteration": 2, "has_optimizer_state": True}

    fresh, fresh_opt, fresh_sched = training_state(seed=2)
    assert any(not torch.equal(v, weights(fresh)[k]) for k, v in expected.items())
    state = ckpt.load_checkpoint(ckpt.resolve_checkpoint(root), fresh, fresh_opt, fresh_sched)
    assert state == {"iteration": 2}
    for key, value in weights(fresh).items():
        assert torch.equal(value, expected[key]), key


def test_keep_last_prunes_old_checkpoints_only_after_the_pointer_moved(tmp_path):
    root = tmp_path / "ckpts"
    chunks, optimizer, scheduler = training_state(seed=1)
    for it in (1, 2, 3):
        ckpt.save_checkpoint(root, it, chunks, optimizer, scheduler, {"iteration": it}, {}, keep_last=2)
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert ckpt.latest_iteration(root) == 3


def test_resolve_rejects_a_pointer_to_an_incomplete_checkpoint(tmp_path):
    from epas_megatron.errors import ConfigError

    root = tmp_path / "ckpts"
    (root / "iter_0000004").mkdir(parents=True)
    (root / ckpt.POINTER).write_text("4")
    with pytest.raises(ConfigError, match="incomplete"):
        ckpt.resolve_checkpoint(root)
    assert ckpt.resolve_checkpoint(tmp_path / "nothing-here") is None
