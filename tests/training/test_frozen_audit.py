"""Frozen Q/K rows in a training run, fp32 and bf16 (Megatron's mixed-precision optimizer: bf16
weights, fp32 main copies), 'qk' and 'kv': in no optimizer group and no DDP bucket after every
switch, no gradient, bit-unchanged to the end with weight decay on; every trainable parameter in
both, the sharing layers' trainable weights moving (tests/frozen_check.py). The GPU suite runs the
same audit with the distributed optimizer and Transformer Engine layers
(tests/gpu/test_gpu_frozen_qk.py)."""

import pytest

from frozen_check import ARGS, assert_frozen, run_audited


@pytest.mark.parametrize("precision, share", [("fp32", "qk"), ("bf16", "qk"), ("bf16", "kv")])
def test_frozen_rows_stay_out_of_the_optimizer_and_do_not_move(tmp_path, precision, share):
    record = run_audited([*ARGS, "--precision", precision, "--epas-share", share], tmp_path / "run")
    assert "EPAS switch at iteration 9" in record["stdout"], record["stdout"][-2000:]
    assert_frozen(record, "linear_qk" if share == "qk" else "linear_kv")
