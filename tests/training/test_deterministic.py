"""--deterministic (deterministic GPU kernels) takes effect and, on CPU, already deterministic,
changes no number.

The runs go through the trainer in this process, so the test sees what the flag did: the
trainer calls :func:`~epas_megatron.runtime.device.use_deterministic_kernels` exactly when the
flag is given (a run without it is the negative control), after which PyTorch's deterministic
algorithms are on and cuBLAS's workspace is pinned, and Megatron's model config carries
``deterministic_mode``."""

import os

import torch

from epas_testing import TINY, run_trainer

ARGS = [*TINY, "--train-iters", "4", "--epas-target-layers", "1", "--epas-interval", "2", "--seed", "2"]


def test_deterministic_flag_takes_effect_and_changes_nothing_on_cpu(tmp_path, monkeypatch):
    import epas_megatron.model.builder as builder
    import epas_megatron.training.trainer as trainer

    calls, modes = [], []
    use_deterministic_kernels, build_model = trainer.use_deterministic_kernels, builder.build_model

    def recording_kernels():
        use_deterministic_kernels()
        calls.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")))

    def recording_build(plan, *args, **kwargs):
        built = build_model(plan, *args, **kwargs)
        modes.append(built.chunks[0].config.deterministic_mode)
        return built

    monkeypatch.setattr(trainer, "use_deterministic_kernels", recording_kernels)
    monkeypatch.setattr(builder, "build_model", recording_build)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    plain = run_trainer(ARGS, tmp_path / "plain", in_process=True)
    assert calls == [] and modes and not any(modes)
    modes.clear()
    deterministic = run_trainer([*ARGS, "--deterministic"], tmp_path / "det", in_process=True)
    assert calls == [(True, ":4096:8")]
    assert modes and all(modes)
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the run
    assert deterministic.losses == plain.losses and len(plain.losses) == 4
    assert deterministic.grad_norms == plain.grad_norms
