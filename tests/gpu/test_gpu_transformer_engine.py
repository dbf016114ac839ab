"""Transformer Engine layers (skipped where TE does not import): TE sharing layers equal local
sharing layers within bf16 tolerance, checkpoints move between TE and local layers, and a TE run
switches and resumes."""

import pytest
import torch

from epas_testing import TINY, assert_close, run_trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not __import__("epas_megatron.model.fusions", fromlist=["x"]).transformer_engine_importable(),
        reason="Transformer Engine is not installed on this node (pip install -r requirements-gpu.txt)",
    ),
]


def _arch():
    from epas_megatron.model.architecture import LlamaArchitecture

    return LlamaArchitecture(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                             ffn_hidden_size=704, vocab_size=512, max_sequence_length=128, init_method_std=0.05)


def _model(backend, sharing, share="qk", seed=None):
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model

    plan = BuildPlan.for_region(_arch(), sharing, precision="bf16", backend=backend, share=share)
    return build_model(plan, seed=seed).chunks[0]


def _save(model, root):
    from epas_megatron.checkpointing.checkpoint import save_checkpoint

    return save_checkpoint(root, 1, [model], None, None, {}, {})


def _load(path, model):
    from epas_megatron.checkpointing.checkpoint import load_checkpoint

    load_checkpoint(path, [model], restore_rng=False)
    return model


def _loss(model, tokens):
    pos = torch.arange(tokens.size(1), device="cuda").unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, pos, None, labels=tokens).float().mean().item()


@pytest.mark.parametrize("share", ["qk", "kv"])
@pytest.mark.parametrize("region", [0, 1, 2], ids=["region0", "region1", "half"])
def test_te_layers_equal_local_layers(world, tmp_path, share, region):
    sharing = tuple(range(4 - region, 4))
    local = _model("local", sharing, share, seed=7)
    te = _load(_save(local, tmp_path / "ckpt"), _model("transformer_engine", sharing, share))
    tokens = torch.randint(0, 512, (2, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    local_loss, te_loss = _loss(local, tokens), _loss(te, tokens)
    assert abs(te_loss - local_loss) <= 1e-2 * local_loss, (local_loss, te_loss)


def test_te_checkpoint_loads_into_local_layers_and_back(world, tmp_path):
    te = _model("transformer_engine", (2, 3), seed=9)
    local = _load(_save(te, tmp_path / "a"), _model("local", ()))  # any region, other backend
    back = _load(_save(local, tmp_path / "b"), _model("transformer_engine", (2, 3)))
    te_params = dict(te.named_parameters())
    for name, param in back.named_parameters():
        assert torch.equal(param, te_params[name]), name


ARGS = [*TINY, "--train-iters", "8", "--global-batch-size", "8", "--micro-batch-size", "4",
        "--epas-target-layers", "2", "--epas-interval", "2", "--epas-first-switch", "3", "--seed", "5",
        "--transformer-impl", "transformer_engine", "--deterministic"]


def test_te_run_switches_and_resumes(tmp_path):
    whole = run_trainer([*ARGS, "--save-interval", "1", "--keep-last", "0"], tmp_path / "whole")
    assert "transformer_engine layers" in whole.stdout.splitlines()[0]
    assert [s["iteration"] for s in whole.switches] == [3, 5]
    resumed = run_trainer([*ARGS, "--load", str(whole.output_dir / "checkpoints" / "iter_0000005")], tmp_path / "part")
    # TE's fused attention may not be bitwise reproducible even in deterministic mode; a state
    # that failed to load shows as a far larger difference.
    assert_close(resumed.losses, {k: v for k, v in whole.losses.items() if k > 5}, 1e-3, "TE resume loss")
