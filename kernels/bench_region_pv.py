"""Microbenchmark of the region P.V kernel against the op it replaces, in one run on the same inputs.

    python -m epas_kernels.bench_region_pv                 # CUDA if available, else CPU
    python -m epas_kernels.bench_region_pv --device cpu --length 64 --repeats 3

The op it replaces is the ``torch`` path of :mod:`epas_kernels.region_pv`: one broadcast batched
``torch.matmul`` over the region's ``L`` layers (:func:`region_pv_reference`). The Triton kernel
(:func:`region_pv_triton`) must first match it on the benchmark's own inputs (fp32: max abs error
<= 1e-4; bf16/fp16: max error <= 2e-2 of the largest output, the tests' bounds); on a mismatch
nothing is timed and the exit status is 1. Then each path is timed over ``--repeats`` repeats of
``--iters`` calls after ``--warmup`` calls (CUDA events on a GPU, ``perf_counter`` on CPU) and the
median per call is reported for both, with the ratio ``torch / triton`` (> 1: the kernel is
faster) and the bandwidth each reaches on the region's bytes (:func:`region_pv_bytes`).

On CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set here before Triton is
imported, so run this as its own process): the correctness check is real, the kernel's time is
the interpreter's and says nothing about a GPU. Defaults: on CUDA the 125m model's decode region at
batch 1 (6 sharing layers, 12 KV groups, one query row, head dim 64, 2048 cached positions, bf16);
on CPU a small fp32 shape the interpreter runs in seconds.

The last line of the output is ``RESULT {json}`` (shapes, device, the check, both medians, ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

CUDA_DEFAULTS = dict(layers=6, batch=1, groups=12, rows=1, length=2048, head_dim=64, dtype="bf16", repeats=20, iters=100, warmup=10)
CPU_DEFAULTS = dict(layers=3, batch=1, groups=2, rows=2, length=128, head_dim=32, dtype="fp32", repeats=5, iters=1, warmup=1)

DTYPES = ("fp32", "bf16", "fp16")
FP32_ATOL = 1e-4
HALF_RELATIVE = 2e-2


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m epas_kernels.bench_region_pv",
        description="Time the Triton region P.V kernel against the batched torch.matmul it replaces, on the same inputs, after "
                    "checking that both give the same result. Sizes not given take the device's defaults "
                    f"(CUDA: {CUDA_DEFAULTS}; CPU, in Triton's interpreter: {CPU_DEFAULTS}).")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA if torch sees a GPU, else CPU (the kernel then runs in Triton's interpreter)")
    parser.add_argument("--layers", type=int, help="L: sharing layers of the region")
    parser.add_argument("--batch", type=int, help="b: sequences")
    parser.add_argument("--groups", type=int, help="g: KV groups")
    parser.add_argument("--rows", type=int, help="m: query rows per KV group (query heads per group x new tokens)")
    parser.add_argument("--length", type=int, help="cached positions used")
    parser.add_argument("--max-length", type=int, help="positions the V caches hold (default: --length)")
    parser.add_argument("--head-dim", type=int, help="d: head dimension")
    parser.add_argument("--dtype", choices=DTYPES, help="the V caches' dtype (P is cast to it)")
    parser.add_argument("--splits", type=int, help="position splits for the kernel (default: its own choice)")
    parser.add_argument("--block-t", type=int, default=32, help="the kernel's positions per step (default 32)")
    parser.add_argument("--repeats", type=int, help="timed repeats; the median is reported")
    parser.add_argument("--iters", type=int, help="calls per timed repeat")
    parser.add_argument("--warmup", type=int, help="untimed calls of each path first (compilation, caches)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return args


def _resolve(args: argparse.Namespace, cuda: bool) -> argparse.Namespace:
    for key, value in (CUDA_DEFAULTS if cuda else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.max_length is None:
        args.max_length = args.length
    for key in ("layers", "batch", "groups", "rows", "length", "head_dim", "repeats", "iters"):
        if getattr(args, key) < 1:
            raise SystemExit(f"error: --{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.max_length < args.length:
        raise SystemExit(f"error: --max-length {args.max_length} < --length {args.length}")
    if args.warmup < 0:
        raise SystemExit(f"error: --warmup must be >= 0, got {args.warmup}")
    return args


def _time_per_call(fn: Callable[[], object], repeats: int, iters: int, warmup: int, cuda: bool) -> list[float]:
    """Seconds per call, one entry per repeat."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - start) / iters)
    return times


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.3f} ms"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import torch  # does not import Triton: TRITON_INTERPRET can still be chosen below

    cuda = args.device != "cpu" and torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if cuda and interpret:
        print("error: TRITON_INTERPRET=1 is set: unset it to time the compiled kernel on the GPU, or pass --device cpu",
              file=sys.stderr)
        return 2
    if not cuda and not interpret:
        if "triton" in sys.modules:
            print("error: Triton was imported before TRITON_INTERPRET=1 could be set; run the benchmark as its own process "
                  "(python -m epas_kernels.bench_region_pv) or set TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    except ImportError as error:
        print(f"error: Triton is not importable ({error}); the kernel needs it (pip install triton)", file=sys.stderr)
        return 2
    from epas_kernels.region_pv import launch_plan, region_pv_bytes, region_pv_reference, region_pv_triton

    args = _resolve(args, cuda)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    L, b, g, m, length, t_max, d = args.layers, args.batch, args.groups, args.rows, args.length, args.max_length, args.head_dim
    gen = torch.Generator(device=device).manual_seed(args.seed)
    # P in the caches' dtype, as the engine hands it over (no cast inside either path)
    probs = torch.softmax(torch.randn(b, g, m, t_max, generator=gen, device=device, dtype=torch.float32), dim=-1).to(dtype)
    values = torch.randn(L, b, g, t_max, d, generator=gen, device=device, dtype=torch.float32).to(dtype)

    def torch_path():
        return region_pv_reference(probs, values, length)

    def triton_path():
        return region_pv_triton(probs, values, length, block_t=args.block_t, splits=args.splits)

    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if cuda else None
    plan = launch_plan(L, b, g, m, d, length, args.block_t, splits=args.splits, sm_count=sm_count)
    where = f"cuda ({torch.cuda.get_device_name(device)})" if cuda else "cpu (Triton interpreter)"
    print(f"region P.V: L={L} b={b} g={g} m={m} length={length} max_length={t_max} d={d} {args.dtype} on {where}; "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"kernel plan: block_m={plan.block_m} block_l={plan.block_l} block_d={plan.block_d} d_tiles={plan.d_tiles} "
          f"splits={plan.splits} ({plan.positions_per_split} positions each), block_t={args.block_t}")

    # Correctness first, on these inputs; both in fp32 for the comparison.
    expected, ours = torch_path().float(), triton_path().float()
    abs_error = (ours - expected).abs().max().item() if expected.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    if dtype == torch.float32:
        limit, error, kind = FP32_ATOL, abs_error, "max abs error"
    else:
        limit, error, kind = HALF_RELATIVE, abs_error / max(scale, 1e-30), "max error / max |output|"
    match = bool(error <= limit)
    print(f"check: triton vs torch {kind} {error:.3g} (limit {limit:g}): {'match' if match else 'MISMATCH'}")
    result = {"device": device.type, "dtype": args.dtype, "shape": {"layers": L, "batch": b, "groups": g, "rows": m, "length": length,
              "max_length": t_max, "head_dim": d}, "splits": plan.splits, "match": match, "error": error, "limit": limit}
    if not match:
        print("not timed: the kernel does not match the torch path on these inputs")
        print("RESULT " + json.dumps(result))
        return 1

    torch_times = _time_per_call(torch_path, args.repeats, args.iters, args.warmup, cuda)
    triton_times = _time_per_call(triton_path, args.repeats, args.iters, args.warmup, cuda)
    torch_s, triton_s = statistics.median(torch_times), statistics.median(triton_times)
    ratio = torch_s / triton_s
    nbytes = region_pv_bytes(L, b, g, m, length, d, values.element_size())["one_launch"]
    per = f"median of {args.repeats} repeats x {args.iters} calls"
    print(f"torch  (one batched matmul over the layers): {_fmt_time(torch_s)} per call ({per}), {nbytes / torch_s / 1e9:.2f} GB/s")
    print(f"triton (region_pv_triton, one launch):       {_fmt_time(triton_s)} per call ({per}), {nbytes / triton_s / 1e9:.2f} GB/s")
    print(f"ratio torch/triton: {ratio:.3f}x ({'the kernel is faster' if ratio > 1 else 'the kernel is slower'})"
          + ("" if cuda else "; CPU: the kernel ran in Triton's interpreter, its time says nothing about a GPU"))
    result.update(torch_s=torch_s, triton_s=triton_s, ratio=ratio, bytes=nbytes, repeats=args.repeats, iters=args.iters)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
