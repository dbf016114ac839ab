"""Run the project's data -> model paths in a device-guard process (meta stands in for the GPU).

    python device_guard_check.py trainer          # one process: the trainer's real data + Megatron's schedule
    torchrun --nproc-per-node 2 device_guard_check.py pipeline   # PP=2 chunks, benchmark inputs

Prints ``GUARD {json}``: for each path, "ok" or the error; ``negative_control`` must be a
DevicePlacementError (a CPU batch fed straight to the model, the bug this guard exists for).
"""

import json
import sys

from epas_megatron.compat import device_guard

CHECK = device_guard.activate()  # before anything builds a model

import torch  # noqa: E402

from epas_megatron.runtime.distributed import destroy_distributed, init_distributed  # noqa: E402


def attempt(results: dict, name: str, fn) -> None:
    try:
        with CHECK:
            fn()
        results[name] = "ok"
    except Exception as error:  # reported, the test decides
        results[name] = f"{type(error).__name__}: {error}"


def synthetic(arch, seq, batch):
    from epas_megatron.bench.common import SyntheticTokens

    return SyntheticTokens(arch.vocab_size, seq, batch, seed=1)


def trainer_paths(results: dict) -> None:
    import tempfile

    from epas_megatron.config.cli import parse_config
    from epas_megatron.engine.step import _run_schedule
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    out = tempfile.mkdtemp()
    argv = ["--preset", "tiny", "--no-tensorboard", "--train-iters", "2", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--eval-interval", "1", "--eval-iters", "1", "--output-dir", out]
    trainer = Trainer(resolve_run(parse_config(argv), world_size=1))
    trainer.setup()
    try:
        params = {p.device.type for chunk in trainer.model for p in chunk.parameters()}
        results["parameter_devices"] = sorted(params)
        cfg = trainer.cfg.training

        def negative_control():
            batch = next(trainer.data.train_iterators[0])  # CPU tensors, not moved
            trainer.model[0](batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        attempt(results, "negative_control", negative_control)
        # Collectives cannot run on meta tensors: the DP gradient reduction after the backward
        # pass is left out; every forward and backward computation runs.
        trainer.tf_config.finalize_model_grads_func = None
        attempt(results, "train_schedule", lambda: _run_schedule(
            trainer.model, trainer.data.train_iterators, trainer.run.num_microbatches, trainer.schedule_seq_length,
            cfg.micro_batch_size, False))
        attempt(results, "eval_schedule", lambda: _run_schedule(
            trainer.model, trainer.data.valid_iterators(trainer.model), trainer.run.num_microbatches, trainer.schedule_seq_length,
            cfg.micro_batch_size, True))
    finally:
        trainer.close()


def pipeline_paths(results: dict) -> None:
    """PP=2, the sharing region crossing the stage boundary (the hand-off rides in the input)."""
    from megatron.core import parallel_state

    from epas_megatron.bench.common import bench_variant
    from epas_megatron.bench.pipeline_bench import _stage_compute_seconds
    from epas_megatron.engine.step import forward_step
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model

    init_distributed(1, 2, None, seed=0)
    try:
        arch = LlamaArchitecture(4, 64, 4, 2, 128, 256, 32)
        built = build_model(BuildPlan.for_region(arch, (2, 3), seq_length=32, pp=2))
        chunk = built.chunks[0]
        rank = parallel_state.get_pipeline_model_parallel_rank()
        results["rank"] = rank
        data = synthetic(arch, 32, 2)

        def stage_forward_backward():
            if not chunk.pre_process:
                rows = chunk.decoder.p2p_rows[1]
                chunk.set_input_tensor(torch.zeros(rows, 2, arch.hidden_size, device=device_guard.GUARD_DEVICE,
                                                   requires_grad=True))
            output, loss_fn = forward_step(data, chunk)
            if chunk.post_process:
                loss_fn(output)[0].backward()
            else:
                output.backward(torch.ones_like(output))

        attempt(results, "forward_step_stage", stage_forward_backward)
        state = bench_variant(BuildPlan.for_region(arch, (2, 3), seq_length=32, pp=2), micro_batch_size=2, num_microbatches=1, seed=0)
        attempt(results, "bench_stage_compute", lambda: _stage_compute_seconds(state, arch.hidden_size, repeats=1))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    mode = sys.argv[1]
    results: dict = {"mode": mode}
    if mode == "trainer":
        trainer_paths(results)
    else:
        pipeline_paths(results)
    print("GUARD " + json.dumps(results), flush=True)
