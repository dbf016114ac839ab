"""GEMM extra state (Transformer Engine's FP8 metadata) through region changes, on CPU.

Transformer Engine's GEMMs carry a non-empty ``_extra_state`` and, unlike Megatron's local
``ColumnParallelLinear``, supply no default when a strict load misses it. A stand-in GEMM with
exactly those two properties replaces the local column-parallel GEMM here, so the switch/resume
path a TE run takes -- computing layer -> sharing layer -> computing layer through distributed
checkpoints, and plain state dicts -- is exercised without TE: the strict loads must succeed and
the running GEMM must keep the fused GEMM's extra state.
"""

import itertools

import pytest
import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear

pytestmark = pytest.mark.usefixtures("single_process")

_CALIBRATION = itertools.count(1)


class ExtraStateColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel GEMM with TE's extra-state behaviour (see module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._load_state_dict_pre_hooks.clear()  # no default for a missing _extra_state
        self.calibration = torch.tensor([float(next(_CALIBRATION))])

    def get_extra_state(self):
        return self.calibration.clone()

    def set_extra_state(self, state):
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"extra state must be a tensor, got {state!r}")
        self.calibration = state.clone()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)


@pytest.fixture
def te_like_backend(monkeypatch):
    """The builder's local backend with the stand-in column-parallel GEMM."""
    from epas_megatron.model import specs

    class ExtraStateSpecProvider(specs.EpasLocalSpecProvider):
        def column_parallel_linear(self):
            return ExtraStateColumnParallelLinear

    monkeypatch.setattr(specs, "EpasLocalSpecProvider", ExtraStateSpecProvider)


def _model(arch, sharing):
    from epas_testing import build

    return build(arch, sharing, seed=3)


def _calibrations(model) -> dict:
    """Extra state of the attention GEMM that runs, per layer."""
    out = {}
    for i, layer in enumerate(model.decoder.layers):
        attention = layer.self_attention
        gemm = attention.own_projection if hasattr(attention, "own_projection") else attention.linear_qkv
        out[i] = float(gemm.calibration)
    return out


def _save(model, root):
    from epas_megatron.checkpointing.checkpoint import save_checkpoint

    return save_checkpoint(root, 1, [model], None, None, {}, {})


def test_extra_state_follows_the_running_gemm_through_dist_checkpoints(te_like_backend, tiny_arch, tmp_path):
    from epas_megatron.checkpointing.checkpoint import load_checkpoint

    computing = _model(tiny_arch, ())
    calibrated = _calibrations(computing)
    assert len(set(calibrated.values())) == 4  # distinct per layer, so a mix-up shows
    sharing = _model(tiny_arch, (2, 3))
    load_checkpoint(_save(computing, tmp_path / "a"), [sharing], restore_rng=False)  # strict
    assert _calibrations(sharing) == calibrated
    assert not hasattr(sharing.decoder.layers[3].self_attention.linear_qk, "calibration")  # frozen: no GEMM state

    back = _model(tiny_arch, ())
    load_checkpoint(_save(sharing, tmp_path / "b"), [back], restore_rng=False)
    assert _calibrations(back) == calibrated
    for name, value in computing.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(value, back.state_dict()[name]), name


def test_plain_state_dict_of_a_computing_model_loads_strictly_into_a_sharing_model(te_like_backend, tiny_arch):
    computing = _model(tiny_arch, ())
    sharing = _model(tiny_arch, (2, 3))
    sharing.load_state_dict(computing.state_dict(), strict=True)
    assert _calibrations(sharing) == _calibrations(computing)


def test_extra_state_follows_the_running_gemm_through_the_in_memory_switch(te_like_backend, tiny_arch):
    """The same round trip with --epas-switch-mode memory's exchange (sharded objects matched by
    key, no files): computing -> sharing (2, 3) -> computing."""
    from epas_megatron.checkpointing.in_memory import hold_state
    from epas_megatron.checkpointing.switch_adoption import restore_state

    computing = _model(tiny_arch, ())
    calibrated = _calibrations(computing)
    sharing = _model(tiny_arch, (2, 3))
    restore_state(hold_state([computing], None, None, {}), [sharing], None, None)
    assert _calibrations(sharing) == calibrated
    back = _model(tiny_arch, ())
    restore_state(hold_state([sharing], None, None, {}), [back], None, None)
    assert _calibrations(back) == calibrated
    for name, value in computing.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(value, back.state_dict()[name]), name
