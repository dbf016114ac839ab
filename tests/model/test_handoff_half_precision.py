"""The hand-off in half precision, per token, against the fp32 reference with negative controls
(tests/handoff_check.py). The same check runs on a GPU in tests/gpu/test_gpu_handoff.py."""

import pytest

from epas_testing import build
from handoff_check import architecture, check_handoff

pytestmark = pytest.mark.usefixtures("single_process")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("core_attention", ["sdpa", "unfused"])
@pytest.mark.parametrize("share", ["qk", "kv"])
def test_half_precision_logits_follow_the_reference_and_not_a_wrong_region(precision, core_attention, share):
    from epas_megatron.runtime.wrapping import unwrap_model

    arch = architecture()
    model = build(arch, (2, 3), share=share, precision=precision, core_attention=core_attention).eval()
    check_handoff(model, unwrap_model(model).state_dict(), arch, (2, 3), share)
