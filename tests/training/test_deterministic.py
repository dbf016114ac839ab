"""--deterministic (deterministic GPU kernels) runs everywhere; on CPU, already deterministic, it
changes no number."""

from epas_testing import TINY, run_trainer

ARGS = [*TINY, "--train-iters", "4", "--epas-target-layers", "1", "--epas-interval", "2", "--seed", "2"]


def test_deterministic_flag_changes_nothing_on_cpu(tmp_path):
    plain = run_trainer(ARGS, tmp_path / "plain")
    deterministic = run_trainer([*ARGS, "--deterministic"], tmp_path / "det")
    assert deterministic.losses == plain.losses and len(plain.losses) == 4
    assert deterministic.grad_norms == plain.grad_norms
