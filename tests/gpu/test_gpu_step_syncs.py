"""A training step on the GPU synchronises with the host the same number of times whatever its
micro-batches (issue #33, item 4): counted with PyTorch's sync-debug mode, the way
tests/training/test_host_syncs.py counts host reads on CPU. Also the tied LM head through the
CUDA-graphed decode step (item 1)."""

from pathlib import Path
from unittest import mock

import pytest
import torch

import epas_megatron.engine.step as step
from epas_testing import TINY, train_in_process
from host_reads import cuda_syncs

pytestmark = pytest.mark.gpu


def syncs_per_step(tmp_path: Path, micro_batches: int, precision: str) -> list[int]:
    counts = []
    real = step.train_step

    def counted(*args, **kwargs):
        result = []
        counts.append(cuda_syncs(lambda: result.append(real(*args, **kwargs))))
        return result[0]

    with mock.patch.object(step, "train_step", counted):
        train_in_process([*TINY, "--train-iters", "4", "--global-batch-size", str(2 * micro_batches), "--micro-batch-size", "2",
                          "--epas-target-layers", "1", "--epas-interval", "2", "--no-save-final", "--eval-interval", "0",
                          "--precision", precision], tmp_path / f"{precision}-m{micro_batches}")
    return counts


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_step_synchronises_as_often_with_four_micro_batches_as_with_one(precision, tmp_path):
    """Iterations 2 and 4 (after the first's lazy initialisation, and after the switch at 2:
    iteration 3 rebuilds) synchronise equally often with 1 and 4 micro-batches: nothing per
    micro-batch. The step's own copy is one of them; the rest are Megatron's optimizer (its
    gradient norm, fp16's overflow check)."""
    one, four = syncs_per_step(tmp_path, 1, precision), syncs_per_step(tmp_path, 4, precision)
    assert len(one) == len(four) == 4
    assert one[1] == four[1] and one[3] == four[3], (one, four)
    assert four[3] <= 8, four


def test_a_tied_head_decodes_through_the_cuda_graph_like_full_forwards():
    """A bf16 model whose LM head is tied to the embedding: the CUDA-graphed decode step's logits
    follow the full forward's (the engine hands the head the embedding's weight)."""
    from epas_megatron.inference.decode_step import StaticDecodeStep
    from epas_megatron.inference.engine import DecodeEngine
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed
    from epas_testing import build

    init_distributed(1, 1, None, seed=0)
    try:
        arch = LlamaArchitecture(4, 256, 8, 4, 704, 512, 64, init_method_std=0.1, tie_embeddings=True)
        model = build(arch, (2, 3), precision="bf16").eval()
        ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0)).cuda()
        engine = DecodeEngine(model, "reuse")
        cache = engine.new_cache(1, 24)
        logits = [engine.forward(ids[:, :10], cache)[:, -1]]
        graph = StaticDecodeStep(engine, cache, graph=True)
        assert graph.captured
        for k in range(10, 19):
            logits.append(graph(ids[:, k:k + 1])[:, -1].clone())
        with torch.no_grad():
            full = model(ids[:, :19], torch.arange(19, device="cuda")[None])[0, 9:].float()
        ours = torch.stack(logits, 1)[0]
        assert (ours - full).abs().max() <= 0.05 * full.abs().max()
        assert (ours.argmax(-1) == full.argmax(-1)).float().mean() >= 0.8
    finally:
        destroy_distributed()
