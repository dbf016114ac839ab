"""Would the GPU suite catch a wrong hand-off? Per-token logits of bf16 models on the GPU -- local
layers with SDPA (flash) and unfused attention, Transformer Engine layers where TE imports --
against the fp32 plain-PyTorch reference, with negative controls (a wrong region, no sharing, the
other share kind must be far outside the tolerance): tests/handoff_check.py, which the CPU suite
runs in bf16 and fp16 too (tests/model/test_handoff_half_precision.py). With two GPUs, the
hand-off across pipeline stages over NCCL: every region under PP=2 (1F1B, interleaved, uneven)
gives the PP=1 loss and gradient norm.
"""


import pytest
import torch

from epas_testing import REPO, json_lines, run_script
from handoff_check import architecture, check_handoff

pytestmark = pytest.mark.gpu


def _model(backend, sharing, share, core_attention="sdpa", seed=5):
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model

    plan = BuildPlan.for_region(architecture(), sharing, precision="bf16", backend=backend, share=share,
                                core_attention=core_attention)
    return build_model(plan, seed=seed).chunks[0].eval()


@pytest.mark.parametrize("core_attention", ["sdpa", "unfused"])
@pytest.mark.parametrize("share", ["qk", "kv"])
def test_local_layers_hand_off_on_the_gpu(world, share, core_attention):
    from epas_megatron.runtime.wrapping import unwrap_model

    model = _model("local", (2, 3), share, core_attention)
    assert next(model.parameters()).is_cuda
    measured = check_handoff(model, unwrap_model(model).state_dict(), architecture(), (2, 3), share)
    print(f"local {core_attention} {share}: {measured}")


@pytest.mark.skipif(not __import__("epas_megatron.model.fusions", fromlist=["x"]).transformer_engine_importable(),
                    reason="Transformer Engine is not installed on this node (pip install -r requirements-gpu.txt)")
@pytest.mark.parametrize("share", ["qk", "kv"])
def test_transformer_engine_layers_hand_off_on_the_gpu(world, share, tmp_path):
    """TE layers fuse the norm into the QKV GEMM (other parameter names): the reference weights
    are the TE model's, read back through a checkpoint into local layers."""
    from epas_megatron.checkpointing.checkpoint import load_checkpoint, save_checkpoint
    from epas_megatron.runtime.wrapping import unwrap_model

    te = _model("transformer_engine", (2, 3), share)
    save_checkpoint(tmp_path / "ckpt", 1, [te], None, None, {}, {})
    local = _model("local", (2, 3), share, seed=99)
    load_checkpoint(tmp_path / "ckpt" / "iter_0000001", [local], restore_rng=False)
    measured = check_handoff(te, unwrap_model(local).state_dict(), architecture(), (2, 3), share)
    print(f"transformer_engine {share}: {measured}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the pipeline hand-off over NCCL needs 2 GPUs (PP=2)")
def test_pipeline_hand_off_over_nccl_matches_pp1():
    proc = run_script(REPO / "tests" / "distributed" / "scripts" / "region_layouts.py", nproc=2)
    results = {(r["layout"], r["region"], r["exclude_last"]): r for r in json_lines(proc.stdout, "RESULT")}
    layouts = {layout for layout, _, _ in results} - {"pp1"}
    assert layouts, proc.stdout[-2000:]
    for (layout, region, exclude_last), got in results.items():
        ref = results[("pp1", region, exclude_last)]
        # fp32 on the GPU: cuBLAS and NCCL sum in other orders than one process does
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (layout, region, exclude_last)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3), (layout, region, exclude_last)
    assert len({results[("pp1", r, 0)]["loss"] for r in range(8)}) == 8  # the regions differ
