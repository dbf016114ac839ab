"""--epas-switch-mode memory (default) and checkpoint give bit-identical runs in half precision:
bf16 (fp32 main weights in the mixed-precision optimizer, copied rather than adopted), fp16 with
dynamic loss scaling (skipped steps, so a switch can come before the optimizer has any state),
and bf16 with the distributed optimizer over DP=2. The one place for these layout kinds; TP=2 and
PP=2 x VPP=2 (fp32) are compared in tests/distributed/test_parallel_equivalence.py, PP=2 with
re-layouts in tests/distributed/test_rebalance.py."""

import pytest

from epas_testing import TINY, run_trainer

# Switches at 2 ([3]), 4 ([2, 3]) and 6 ([1, 2, 3]).
ARGS = [*TINY, "--train-iters", "8", "--global-batch-size", "4", "--micro-batch-size", "2", "--epas-target-layers", "3",
        "--epas-interval", "2", "--seed", "9", "--init-method-std", "0.1", "--lr", "3e-3", "--lr-warmup-iters", "1",
        "--no-save-final"]

CASES = {
    "bf16": (["--precision", "bf16"], 1),
    "fp16_dynamic_scale": (["--precision", "fp16", "--initial-loss-scale", str(2.0**40), "--loss-scale-window", "2"], 1),
    "bf16_distributed_optimizer_dp2": (["--precision", "bf16", "--use-distributed-optimizer"], 2),
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.distributed) if nproc > 1 else name
                                  for name, (_, nproc) in CASES.items()])
def test_memory_and_checkpoint_switches_are_bit_identical(name, tmp_path):
    extra, nproc = CASES[name]
    memory = run_trainer([*ARGS, *extra], tmp_path / "memory", nproc=nproc)
    checkpoint = run_trainer([*ARGS, *extra, "--epas-switch-mode", "checkpoint"], tmp_path / "checkpoint", nproc=nproc)
    assert [s["iteration"] for s in memory.switches] == [2, 4, 6]
    assert [s["switch_mode"] for s in memory.switches] == ["memory"] * 3
    assert [s["switch_mode"] for s in checkpoint.switches] == ["checkpoint"] * 3
    assert memory.losses == checkpoint.losses
    assert memory.grad_norms == checkpoint.grad_norms
    if name.startswith("fp16"):  # the scale overflowed at first: some steps were skipped around the switches
        assert memory.summary["skipped_iterations"] == checkpoint.summary["skipped_iterations"] > 0
