"""Frozen Q/K rows stay frozen on the GPU (bf16, a one-GPU NCCL world, the trainer in this
process): after each switch the sharing layers' frozen projection (``linear_qk``; ``linear_kv``
with ``--epas-share kv``) is in no optimizer group -- the distributed optimizer's shards (the GPU
default) or the mixed-precision optimizer's bf16 groups and fp32 main copies -- in no DDP bucket,
has no gradient, and is bit-unchanged to the end of the run through optimizer steps with weight
decay 0.5 at a constant learning rate; every trainable parameter is in both, and the sharing
layers' trainable weights move (tests/frozen_check.py). Local layers, and Transformer Engine
layers where TE imports.

The CPU suite runs the same audit in fp32 and bf16 (tests/training/test_frozen_audit.py).
Written 2026-11-27; not yet run on a GPU.
"""

import pytest

from frozen_check import ARGS, assert_frozen, run_audited

pytestmark = pytest.mark.gpu

TE_MISSING = pytest.mark.skipif(
    not __import__("epas_megatron.model.fusions", fromlist=["x"]).transformer_engine_importable(),
    reason="Transformer Engine is not installed on this node (pip install -r requirements-gpu.txt)")


@pytest.mark.parametrize("backend, optimizer, share", [
    ("local", "distributed", "qk"),
    ("local", "mixed-precision", "qk"),
    ("local", "distributed", "kv"),
    pytest.param("transformer_engine", "distributed", "qk", marks=TE_MISSING),
], ids=["local-distributed", "local-mixed-precision", "local-distributed-kv", "transformer_engine-distributed"])
def test_frozen_rows_stay_out_of_the_optimizer_and_do_not_move_on_the_gpu(tmp_path, backend, optimizer, share):
    distributed = optimizer == "distributed"
    flag = "--use-distributed-optimizer" if distributed else "--no-use-distributed-optimizer"
    record = run_audited([*ARGS, "--transformer-impl", backend, flag, "--epas-share", share], tmp_path / "run")
    (banner,) = [line for line in record["stdout"].splitlines() if line.startswith("epas-megatron: ")]
    assert "CUDA" in banner and "| bf16, " in banner and f" {backend} layers" in banner, banner
    assert (", distributed optimizer" in banner) == distributed, banner
    assert_frozen(record, "linear_qk" if share == "qk" else "linear_kv")
