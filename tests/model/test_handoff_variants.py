"""The hand-off's further controls on CPU (tests/handoff_variants.py), the same functions the GPU
suite runs on CUDA in bf16 (tests/gpu/test_gpu_handoff.py): a pre-RoPE hand-off is caught by the
per-token check; training-mode logits with activation recompute (selective, full) and with
Random-LTD follow the reference, recompute's gradients equal those without it; two sharing blocks
follow the reference and not a wrong block layout. In fp32 and bf16.

The same paths are checked by other means too: recompute against runs without it
(distributed/test_parallel_equivalence.py::test_activation_recompute_matches, loss and grad norm),
Random-LTD against the reference in fp32 (random_ltd/test_model.py, loss and gradients), two blocks
through training and export (training/test_blocks.py)."""

import pytest
import torch

from epas_testing import build
from handoff_check import architecture, tokens
from handoff_variants import (
    BLOCKS_ARCH,
    BLOCKS_SHARING,
    blocks_variants,
    check_logits_follow,
    check_pre_rope_is_caught,
    check_training_logits,
    model_weights,
    run_logits,
)

pytestmark = pytest.mark.usefixtures("single_process")

PRECISIONS = ["fp32", "bf16"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("share", ["qk", "kv"])
def test_a_pre_rope_hand_off_is_caught(precision, share):
    model = build(architecture(), (2, 3), share=share, precision=precision).eval()
    print(check_pre_rope_is_caught(model, architecture(), (2, 3), share))


def _recompute(granularity, layers=1):
    from epas_megatron.model.build_plan import RecomputeSettings

    return RecomputeSettings(granularity, "uniform", layers)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("granularity, layers", [("selective", 1), ("full", 1), ("full", 2)],
                         ids=["selective", "full-per-layer", "full-two-layers"])
def test_training_logits_with_recompute_follow_the_reference(precision, granularity, layers):
    print(check_training_logits(architecture(), (2, 3), "qk", precision, recompute=_recompute(granularity, layers)))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("share", ["qk", "kv"])
def test_training_logits_with_random_ltd_follow_the_reference(precision, share):
    print(check_training_logits(architecture(), (2, 3), share, precision, random_ltd=True))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("share", ["qk", "kv"])
def test_two_sharing_blocks_follow_the_reference(precision, share):
    model = build(BLOCKS_ARCH, BLOCKS_SHARING, share=share, precision=precision, blocks=2).eval()
    batch = tokens()
    with torch.no_grad():
        logits = run_logits(model, batch, BLOCKS_ARCH)
    print(check_logits_follow(logits, model_weights(model, BLOCKS_ARCH), BLOCKS_ARCH, batch, BLOCKS_SHARING, share,
                              blocks_variants(share)))
