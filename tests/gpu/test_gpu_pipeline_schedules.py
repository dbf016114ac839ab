"""Pipeline schedules with controllable memory on GPUs: the weight-gradient split on CUDA (one
GPU), and the V schedules over NCCL (two GPUs), whose point-to-point tensors NCCL matches in
posting order (tags ignored).

References: autograd's own gradients on the same GPU (the split must not change a bit of the
GEMM; only where its sum lands), and Megatron-Core's 1F1B on the same two GPUs.
"""

import pytest
import torch

from epas_testing import TINY, assert_close, run_trainer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_weight_gradients_on_cuda_equal_autograds(world, dtype):
    """A column- and a row-parallel delayed-wgrad linear on CUDA with DDP's fp32 ``main_grad``:
    nothing lands before W, and after it ``main_grad`` holds exactly what the undeferred node's
    gradient adds there (the GEMM in the weights' dtype, accumulated in fp32)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from epas_megatron.model.weight_grad import WEIGHT_GRAD_STORE, DelayedWgradColumnParallelLinear, DelayedWgradRowParallelLinear

    config = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, params_dtype=dtype)
    torch.manual_seed(0)
    for layer in (DelayedWgradColumnParallelLinear(256, 512, config=config, init_method=torch.nn.init.normal_, bias=False,
                                                   gather_output=False),
                  DelayedWgradRowParallelLinear(256, 512, config=config, init_method=torch.nn.init.normal_, bias=False,
                                                input_is_parallel=True, skip_bias_add=False)):
        layer.cuda()
        x = torch.randn(64, 2, 256, device="cuda", dtype=dtype)
        grad_out = torch.randn(64, 2, 512, device="cuda", dtype=dtype)
        layer(x)[0].backward(grad_out)  # disarmed: Megatron's own node
        want = torch.zeros_like(layer.weight, dtype=torch.float32).add_(layer.weight.grad)
        layer.weight.grad = None
        layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
        with WEIGHT_GRAD_STORE.arming():
            out = layer(x)[0]
            with WEIGHT_GRAD_STORE.collecting("pass"):
                out.backward(grad_out)
            assert not layer.weight.main_grad.any() and layer.weight.grad is None
            WEIGHT_GRAD_STORE.run("pass")
        assert torch.equal(layer.weight.main_grad, want)


ARGS = [*TINY, "--train-iters", "6", "--global-batch-size", "8", "--micro-batch-size", "1", "--pp", "2",
        "--epas-target-layers", "2", "--epas-interval", "2", "--epas-first-switch", "3", "--seed", "7",
        "--init-method-std", "0.2", "--no-save-final", "--deterministic", "--core-attention", "unfused",
        "--precision", "fp32", "--epas-rebalance", "off", "--transformer-impl", "local"]
# (local layers: on a node with Transformer Engine, 'auto' would pick TE, whose delayed weight
# gradient is not wired, and v-half / v-min are refused there)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the V schedules over NCCL need 2 GPUs (PP=2)")
@pytest.mark.parametrize("schedule", ["v-1f1b", "v-half", "v-min"])
def test_v_schedules_over_nccl_equal_megatrons_1f1b(schedule, tmp_path):
    """Two GPUs, fp32 with deterministic kernels: a V run with switches (the hand-off crosses the
    turn and the ranks) equals Megatron-Core's 1F1B on the same GPUs to fp32 rounding."""
    reference = run_trainer(ARGS, tmp_path / "1f1b", nproc=2)
    run = run_trainer([*ARGS, "--pipeline-schedule", schedule], tmp_path / schedule, nproc=2)
    assert "CUDA" in run.stdout.splitlines()[0]
    assert [s["sharing_layers"] for s in run.switches] == [[3], [2, 3]]
    assert_close(run.losses, reference.losses, 1e-5, f"{schedule} loss")
    assert_close(run.grad_norms, reference.grad_norms, 1e-5, f"{schedule} grad norm")


REAL_SIZE = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16", "--num-query-groups", "16",
             "--ffn-hidden-size", "5632", "--seq-length", "2048", "--micro-batch-size", "1", "--precision", "bf16",
             "--core-attention", "sdpa"]
"""A pipeline message of ``[2048, 1, 2048]`` bf16: 8 MiB, beyond NCCL's buffers (4 MiB by default), so a
send waits for its receive -- the ``tiny`` preset's 16 KiB messages fit the buffers and hide an order
NCCL would hang on."""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the V schedules over NCCL at a real message size need 2 GPUs")
@pytest.mark.parametrize("schedule", ["v-1f1b", "v-half", "v-min"])
def test_v_schedules_over_nccl_at_a_real_message_size(schedule, tmp_path):
    """Two GPUs, 8 MiB messages (seq 2048, hidden 2048, bf16), with switches: the run finishes
    (the executor's batched exchanges; the order before them hung here in the pure model and under
    the NCCL-rules transport) and its losses follow Megatron-Core's 1F1B on the same GPUs within
    bf16's accumulation-order noise."""
    args = [*(a for a in ARGS if a not in ("--precision", "fp32", "--core-attention", "unfused")), *REAL_SIZE,
            "--train-iters", "4"]
    reference = run_trainer(args, tmp_path / "1f1b", nproc=2, timeout=900)
    run = run_trainer([*args, "--pipeline-schedule", schedule], tmp_path / schedule, nproc=2, timeout=900)
    assert "CUDA" in run.stdout.splitlines()[0]
    assert [s["sharing_layers"] for s in run.switches] == [[3]]
    assert_close(run.losses, reference.losses, 2e-2, f"{schedule} loss")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a point-to-point crossing over NCCL needs 2 GPUs")
def test_unbatched_sends_that_cross_hang_on_nccl_and_batched_ones_run(tmp_path):
    """The hazard itself, at 64 MiB: two ranks each isend to the other before their irecv hang on
    NCCL (the watchdog reports it after 60 s); the same ops in one batch_isend_irecv finish. On
    gloo the crossing runs (tests/distributed/test_nccl_rules.py), and the NCCL-rules transport
    stops it with the pure model's report."""
    import json

    from epas_testing import REPO, json_lines, run_script
    from p2p_orders import crossing_programs

    results = {}
    for batched in (False, True):
        path = tmp_path / f"crossing_{batched}.json"
        path.write_text(json.dumps(crossing_programs(batched)))
        proc = run_script(REPO / "tests" / "distributed" / "scripts" / "p2p_programs.py",
                          [str(path), "--bytes", str(64 << 20), "--hang-after", "60"], nproc=2, timeout=300)
        results[batched] = json_lines(proc.stdout, "RESULT")
    assert all(row["backend"] == "nccl" for rows in results.values() for row in rows)
    assert [row.get("hung") for row in results[False]] == [True, True]
    assert [row.get("ok") for row in results[True]] == [True, True]


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="the schedule benchmark at p = 4 needs 4 GPUs")
def test_schedule_benchmark_on_four_gpus():
    """What only GPUs show: seconds per iteration and the executed bubble of each schedule with
    the doubled p2p traffic of V placement over NVLink/NCCL (printed for the ledger; the speed is
    not asserted), with every schedule's losses equal and V's p2p bytes twice 1F1B's."""
    import json
    import subprocess
    import sys

    from epas_testing import REPO, json_lines

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "epas_megatron.bench.cli",
           "pipeline", "--schedule", "1f1b", "v-1f1b", "v-half", "v-min", "--preset", "small", "--region", "4",
           "--num-microbatches", "16", "--iters", "10"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (record,) = json_lines(proc.stdout, "BENCH")
    print(json.dumps(record, indent=1))
    assert record["losses_agree"], record["max_loss_difference"]
