"""The distributed optimizer (optimizer state and fp32 main weights sharded over DP=2, over gloo)
through EPAS switches: bit-identical resume after a switch in bf16, and checkpoints that reshard
from DP=2 to one process.

Its equivalence with the single-process run (fp32, every iteration, switches included) is in
test_parallel_equivalence.py (variants dp2_distributed_optimizer*).
"""

import pytest

from epas_testing import TINY, assert_close, run_trainer

pytestmark = pytest.mark.distributed

# Switches at 3 ([3]) and 5 ([2, 3]).
ARGS = [*TINY, "--train-iters", "8", "--global-batch-size", "4", "--micro-batch-size", "1",
        "--epas-target-layers", "2", "--epas-interval", "2", "--epas-first-switch", "3",
        "--seed", "11", "--init-method-std", "0.1", "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    return run_trainer([*ARGS, "--precision", "bf16", "--save-interval", "1", "--keep-last", "0"],
                       tmp_path_factory.mktemp("dist") / "run", nproc=2)


def test_bf16_resume_after_a_switch_is_bit_identical(bf16_run, tmp_path):
    assert [s["iteration"] for s in bf16_run.switches] == [3, 5]
    ckpt = bf16_run.output_dir / "checkpoints" / "iter_0000005"
    run = run_trainer([*ARGS, "--precision", "bf16", "--load", str(ckpt)], tmp_path / "run", nproc=2)
    assert run.losses == {k: v for k, v in bf16_run.losses.items() if k > 5}
    assert run.grad_norms == {k: v for k, v in bf16_run.grad_norms.items() if k > 5}


def test_checkpoint_reshards_from_dp2_to_one_process(tmp_path):
    """fp32: a DP=2 checkpoint resumed by one process (distributed optimizer over DP=1, same
    global batch) continues the DP=2 run: the optimizer state is saved per parameter, not per
    DP shard."""
    whole = run_trainer([*ARGS, "--save-interval", "4", "--keep-last", "0"], tmp_path / "whole", nproc=2)
    ckpt = whole.output_dir / "checkpoints" / "iter_0000004"
    single = run_trainer([*ARGS, "--load", str(ckpt)], tmp_path / "single")
    assert_close(single.losses, {k: v for k, v in whole.losses.items() if k > 4}, 1e-5, "DP=1 resume loss")
    assert_close(single.grad_norms, {k: v for k, v in whole.grad_norms.items() if k > 4}, 1e-5, "grad norm")
    assert [s["iteration"] for s in single.switches] == [5]


def test_changing_the_optimizer_kind_on_resume_is_a_clear_error(tmp_path):
    whole = run_trainer([*ARGS, "--train-iters", "5"], tmp_path / "whole", nproc=2)
    plain = [a for a in ARGS if a != "--use-distributed-optimizer"]
    run = run_trainer([*plain, "--load", str(whole.output_dir / "checkpoints")], tmp_path / "plain",
                      check=False)
    assert run.returncode == 2
    assert "--use-distributed-optimizer" in run.stderr and "Traceback" not in run.stderr
