"""The region P·V kernel: the PyTorch path against a per-layer loop, the Triton kernel against
the PyTorch path in Triton's interpreter (a subprocess: the interpreter must be chosen before
Triton is imported) -- every launch shape the interpreter can run: the one-row reduction, the
upcast fp32 ``tl.dot``, the native-dtype ``tl.dot`` branch (fp32 tiles: the interpreter computes
a bf16 ``tl.dot`` wrongly), positions split over programs with the partials summed -- the
launch plan and the split heuristic by hand, the dispatcher's errors, and the byte count by hand."""

import json
import subprocess
import sys

import pytest
import torch

from epas_kernels.region_pv import launch_plan, position_splits, region_pv, region_pv_bytes, region_pv_reference
from epas_testing import REPO

SHAPES = [  # (L, b, g, m, T_max, length, d)
    (1, 1, 1, 1, 8, 5, 16),
    (5, 2, 2, 4, 20, 17, 24),  # GQA rows, length < T, d not a power of two
    (3, 1, 3, 2, 70, 70, 8),  # more than one position tile
]


def inputs(shape, dtype=torch.float32, seed=0):
    layers, b, g, m, t_max, length, d = shape
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(b, g, m, t_max, generator=gen), dim=-1)
    values = torch.randn(layers, b, g, t_max, d, generator=gen).to(dtype)
    return probs, values, length


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_a_per_layer_loop(shape):
    probs, values, length = inputs(shape)
    expected = torch.stack([torch.einsum("bgmt,bgtd->bgmd", probs[..., :length], values[l, :, :, :length])
                            for l in range(values.size(0))])
    torch.testing.assert_close(region_pv_reference(probs, values, length), expected, rtol=1e-5, atol=1e-6)


_INTERPRETED = """
import json, runpy, sys, torch
sys.path.insert(0, {tests!r})
# this file by its path: the name `kernels` is the repository's kernels/ folder (epas_kernels) too
_this = runpy.run_path({this!r})
SHAPES, inputs = _this["SHAPES"], _this["inputs"]
from epas_kernels.region_pv import region_pv, region_pv_reference, region_pv_triton
errors = {{}}
for shape in SHAPES:
    probs, values, length = inputs(shape)
    errors[str(shape)] = (region_pv(probs, values, length, kernel="triton") - region_pv_reference(probs, values, length)).abs().max().item()
# all layers and a 16-column d-tile per program: two d-tiles (the second partial), P read twice
probs, values, length = inputs(SHAPES[1])
ours = region_pv_triton(probs, values, length, max_columns=16 * 8)
errors["d_tiles"] = (ours - region_pv_reference(probs, values, length)).abs().max().item()
# strided inputs (no copy of the cache): V a slice of wider heads, P a transposed tensor
probs, values, length = inputs((3, 2, 2, 3, 12, 9, 20))
wide = torch.randn(*values.shape[:-1], 32)
wide[..., :20] = values
probs_t = probs.transpose(-1, -2).contiguous().transpose(-1, -2)
ours = region_pv(probs_t, wide[..., :20], length, kernel="triton")
errors["strided"] = (ours - region_pv_reference(probs, values, length)).abs().max().item()
probs, values, length = inputs(SHAPES[1], dtype=torch.bfloat16)
ours = region_pv(probs, values, length, kernel="triton").float()
ref = region_pv_reference(probs.float(), values.float(), length)
errors["bf16"] = ((ours - ref).abs().max() / ref.abs().max()).item()
# positions split over programs (block_t 16): (L, b, g, m, T, length, d) and the splits asked for
for shape, splits in [((5, 2, 2, 4, 20, 17, 24), 2), ((3, 1, 3, 2, 70, 70, 8), 3), ((2, 1, 2, 1, 300, 290, 16), 5),
                      ((2, 1, 2, 1, 300, 290, 16), 100), ((4, 2, 1, 3, 64, 64, 40), 4)]:
    probs, values, length = inputs(shape, seed=7)
    for upcast in (True, False):  # False: the native-dtype tl.dot branch, here on fp32 tiles
        ours = region_pv_triton(probs, values, length, block_t=16, splits=splits, upcast=upcast)
        errors[f"split {{shape}} {{splits}} {{upcast}}"] = (ours - region_pv_reference(probs, values, length)).abs().max().item()
    probs, values, length = inputs(shape, dtype=torch.bfloat16, seed=7)
    ours = region_pv_triton(probs, values, length, block_t=16, splits=splits).float()
    ref = region_pv_reference(probs.float(), values.float(), length)
    errors[f"split bf16 {{shape}} {{splits}}"] = ((ours - ref).abs().max() / ref.abs().max()).item()
print("ERRORS " + json.dumps(errors))
"""


def test_triton_kernel_equals_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    code = _INTERPRETED.format(tests=str(REPO / "tests"), this=__file__)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads([l for l in proc.stdout.splitlines() if l.startswith("ERRORS ")][-1][7:])
    for shape in [*map(str, SHAPES), "d_tiles", "strided"]:
        assert errors[shape] < 1e-5, (shape, errors[shape])
    # bf16 inputs, fp32 accumulation: within bf16's rounding of the inputs and output
    assert errors["bf16"] < 2e-2
    split = {key: error for key, error in errors.items() if key.startswith("split")}
    assert len(split) == 15
    for key, error in split.items():
        assert error < (2e-2 if "bf16" in key else 1e-5), (key, error)


def test_dispatcher_errors():
    probs, values, length = inputs(SHAPES[0])
    with pytest.raises(ValueError, match="unknown region kernel 'cuda'"):
        region_pv(probs, values, length, kernel="cuda")
    if "TRITON_INTERPRET" not in __import__("os").environ:
        with pytest.raises(RuntimeError, match="needs a CUDA device, or TRITON_INTERPRET=1"):
            region_pv(probs, values, length, kernel="triton")
    with pytest.raises(ValueError, match="length 9 outside"):
        region_pv(probs, values, 9)


def test_position_splits_by_hand():
    # 125m at batch 1: b*g*(d-tiles) = 1*12*2 = 24 programs on 132 SMs -> ceil(264 / 24) = 11 splits,
    # at most 2048 // 128 = 16 ranges of 128 positions; 512 positions allow only 4.
    assert position_splits(24, 2048, 132) == 11
    assert position_splits(24, 512, 132) == 4
    assert position_splits(24, 100, 132) == 1  # too short to split
    assert position_splits(192, 2048, 132) == 1  # batch 8: the grid fills the SMs already
    assert position_splits(24, 2048, None) == 1  # not a GPU


def test_launch_plan_by_hand():
    # 125m decode at batch 1 (L 6 sharing layers, g 12, m 1 row, d 64) on an H100 (132 SMs):
    # one-row reduction; 8 layer slots x 32 dims = 256 columns; 2 d-tiles; 11 splits of
    # 32 * ceil(64 blocks / 11) = 192 positions -> ceil(2048 / 192) = 11 ranges.
    plan = launch_plan(6, 1, 12, 1, 64, 2048, sm_count=132)
    assert (plan.block_m, plan.block_l, plan.block_d, plan.d_tiles) == (1, 8, 32, 2) and plan.one_row
    assert (plan.positions_per_split, plan.splits) == (192, 11)
    # GQA rows (m 4 -> 16 for tl.dot), L 2 x d 128 fits in 256 columns: one d-tile. Batch 8: 96
    # programs -> ceil(264 / 96) = 3 splits of 32 * ceil(64 / 3) = 704 positions; batch 16: 192
    # programs fill the SMs, no split.
    plan = launch_plan(2, 8, 12, 4, 128, 2048, sm_count=132)
    assert (plan.block_m, plan.block_l, plan.block_d, plan.d_tiles) == (16, 2, 128, 1) and not plan.one_row
    assert (plan.positions_per_split, plan.splits) == (704, 3)
    plan = launch_plan(2, 16, 12, 4, 128, 2048, sm_count=132)
    assert (plan.positions_per_split, plan.splits) == (2048, 1)
    # A request beyond the number of 32-position blocks (70 positions: 3 blocks) gives 3 ranges.
    plan = launch_plan(3, 1, 3, 2, 8, 70, splits=100)
    assert (plan.positions_per_split, plan.splits) == (32, 3)
    # 290 positions in 5 requested ranges of block 16: 19 blocks -> 4 blocks (64 positions) each -> 5 ranges.
    plan = launch_plan(2, 1, 2, 1, 16, 290, block_t=16, splits=5)
    assert (plan.positions_per_split, plan.splits) == (64, 5)


def test_bytes_by_hand():
    # L=3 layers, b=2, g=2, m=4, length=10, d=8, fp32: P 2*2*4*10*4 = 640 B; V 3*2*2*10*8*4 = 3840 B;
    # out 3*2*2*4*8*4 = 1536 B.
    assert region_pv_bytes(3, 2, 2, 4, 10, 8, 4) == {"one_launch": 640 + 3840 + 1536, "per_layer": 3 * 640 + 3840 + 1536}


_ENGINE = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from epas_testing import build
from epas_megatron.runtime.distributed import init_distributed
from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.inference.engine import DecodeEngine
from inference.test_engine import cached_greedy, prompts
init_distributed(1, 1, None, seed=1)
arch = LlamaArchitecture(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=176, vocab_size=256, max_sequence_length=32, init_method_std=0.2)
model = build(arch, (2, 3)).eval()
batch = prompts(256, seed=2)
qk_tokens, qk_logits, _ = cached_greedy(DecodeEngine(model, "qk"), batch)
result = {{}}
for static in (False, True):  # eager steps, and the fixed-shape step (P with the new slot zeroed, every slot)
    tri_tokens, tri_logits, _ = cached_greedy(DecodeEngine(model, "reuse", region_kernel="triton"), batch, static=static, spare=2)
    result[str(static)] = {{"same_tokens": qk_tokens == tri_tokens, "max_error": (qk_logits - tri_logits).abs().max().item()}}
print("ENGINE " + json.dumps(result))
"""


def test_engine_with_the_triton_kernel_generates_the_qk_paths_tokens():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", _ENGINE.format(tests=str(REPO / "tests"))], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([l for l in proc.stdout.splitlines() if l.startswith("ENGINE ")][-1][7:])
    for static in ("False", "True"):
        assert result[static]["same_tokens"] and result[static]["max_error"] < 1e-4, result
