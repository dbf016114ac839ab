"""Shared fixtures of the EPAS Hugging Face export tests: ONE tiny EPAS training run (share 'qk',
region [2, 3] of 4 layers), its exports, and helpers to run this framework's own model on it.

The references the tests compare with are independent of ``epas_megatron.hf``: this framework's
Megatron model built at a region and loaded from the checkpoint (the ``framework_model`` fixture), the
plain-PyTorch forward of ``llama_reference`` and transformers' own ``LlamaForCausalLM``.
"""

from __future__ import annotations

import pytest
import torch

from epas_megatron.convert.cli import main as convert
from epas_testing import TINY, hf_offline, run_trainer

LAYERS, HEADS, GROUPS = 4, 4, 2
"""The tiny preset's shape."""

TRAINED = (2, 3)
"""The trained sharing region of the fixture run."""


offline = pytest.fixture(scope="package", autouse=True)(hf_offline)  # epas_testing.hf_offline


@pytest.fixture(scope="package")
def checkpoint(tmp_path_factory):
    """3 iterations: region [3] from iteration 1, [2, 3] from iteration 2 (both trained in sharing mode)."""
    run = run_trainer([*TINY, "--train-iters", "3", "--global-batch-size", "2", "--micro-batch-size", "2",
                       "--epas-target-layers", "2", "--epas-interval", "1", "--init-method-std", "0.1", "--lr", "1e-3"],
                      tmp_path_factory.mktemp("hf_export") / "run")
    assert [s["sharing_layers"] for s in run.switches] == [[3], list(TRAINED)]
    return run.output_dir / "checkpoints"


@pytest.fixture(scope="package")
def exported(checkpoint, tmp_path_factory):
    """``hf-export --region max``: the EPAS directory."""
    path = tmp_path_factory.mktemp("export") / "epas"
    assert convert(["hf-export", "--load", str(checkpoint), "--output", str(path), "--region", "max"]) == 0
    return path


@pytest.fixture(scope="package")
def plain_exported(checkpoint, tmp_path_factory):
    """``hf-export`` without ``--region``: plain LLaMA weights (every layer's own Q/K)."""
    path = tmp_path_factory.mktemp("export") / "plain"
    assert convert(["hf-export", "--load", str(checkpoint), "--output", str(path)]) == 0
    return path


@pytest.fixture(scope="package")
def reference_weights(plain_exported):
    from safetensors.torch import load_file

    from llama_reference import weights_from_hf_style

    return weights_from_hf_style(load_file(plain_exported / "model.safetensors"), LAYERS)


def _load_export(path, **kwargs):
    """The export as ``transformers`` loads it for a user: remote code, fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32, **kwargs)


def _framework_model(checkpoint, region: int):
    """This framework's model (fp32, local layers) at ``region`` with the checkpoint loaded; needs
    a world of one (the ``world`` fixture)."""
    from epas_megatron.assembly import plan_for_checkpoint
    from epas_megatron.checkpointing.checkpoint import load_checkpoint
    from epas_megatron.checkpointing.integrity import open_checkpoint
    from epas_megatron.model.builder import build_model

    resolved, meta = open_checkpoint(checkpoint, "--load", needs_config=True)
    model = build_model(plan_for_checkpoint(meta, region, precision="fp32", backend="local"), seed=0).chunks[0]
    load_checkpoint(resolved, [model], restore_rng=False)
    return model


@pytest.fixture(scope="package")
def load_export():
    """``load_export(path, **from_pretrained kwargs)``: see :func:`_load_export`."""
    return _load_export


@pytest.fixture(scope="package")
def framework_model():
    """``framework_model(checkpoint, region)``: see :func:`_framework_model`."""
    return _framework_model


@pytest.fixture
def world():
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    init_distributed(1, 1, None, seed=0)
    try:
        yield
    finally:
        destroy_distributed()


@pytest.fixture(scope="package")
def tokens():
    """Two sequences of 24 random ids of the 512-piece vocabulary."""
    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
