"""The region P.V microbenchmark (``python -m epas_kernels.bench_region_pv``) at a tiny size on CPU:
it checks the Triton kernel (in Triton's interpreter, chosen by the benchmark itself before Triton is
imported: hence its own process) against the torch path on its inputs, then reports both times and
their ratio."""

import json
import re
import subprocess
import sys

import pytest

from epas_kernels import bench_region_pv
from epas_testing import REPO

TINY = ["--device", "cpu", "--layers", "2", "--batch", "1", "--groups", "2", "--rows", "3", "--length", "40", "--max-length", "48",
        "--head-dim", "16", "--repeats", "3", "--iters", "1", "--warmup", "0"]


def test_microbenchmark_checks_the_kernel_then_times_both_paths(capsys):
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-m", "epas_kernels.bench_region_pv", *TINY], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    out = proc.stdout
    assert "L=2 b=1 g=2 m=3 length=40 max_length=48 d=16 fp32 on cpu (Triton interpreter)" in out, out
    assert re.search(r"^check: triton vs torch max abs error \S+ \(limit 0\.0001\): match$", out, re.M), out
    # both times, from the same run, and their ratio
    per_call = r"[\d.]+ (us|ms) per call \(median of 3 repeats x 1 calls\)"
    assert re.search(r"^torch  \(one batched matmul over the layers\): " + per_call, out, re.M), out
    assert re.search(r"^triton \(region_pv_triton, one launch\): +" + per_call, out, re.M), out
    assert re.search(r"^ratio torch/triton: [\d.]+x", out, re.M), out
    result = json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    assert result["match"] and result["error"] <= 1e-4 and result["device"] == "cpu"
    assert result["torch_s"] > 0 and result["triton_s"] > 0 and result["ratio"] == pytest.approx(result["torch_s"] / result["triton_s"])
    # --help, in this process (parsing imports neither torch nor Triton)
    with pytest.raises(SystemExit) as exit_:
        bench_region_pv.parse_args(["--help"])
    assert exit_.value.code == 0 and "Time the Triton region P.V kernel against the batched torch.matmul" in capsys.readouterr().out
