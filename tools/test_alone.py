"""Run tests outside CI's configuration: every test file in its own pytest process, or a sample of
single tests each in its own process -- always without ``-n`` -- and list what fails.

CI runs the whole suite once with two xdist workers (``.ci/run``). A test that passes only there
(it reads a variable the runner sets, it needs a fixture another file built first, it relies on
an earlier test's side effect) fails here. Usage::

    .venv/bin/python tools/test_alone.py files                 # every tests/**/test_*.py alone
    .venv/bin/python tools/test_alone.py tests --sample 100     # 100 single tests (seeded), each alone
    .venv/bin/python tools/test_alone.py tests --sample 0      # every single test alone (hours)

``--jobs`` runs that many pytest processes side by side (default 2, this machine's cores). The
GPU folder is left out (it skips without CUDA). Exit status 1 when anything failed; each failure's
output is kept under ``--log-dir``.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_files(root: Path = REPO / "tests") -> list[str]:
    """Every test file under ``root`` except the GPU folder's, as paths relative to the repo."""
    return sorted(str(path.relative_to(REPO)) for path in root.rglob("test_*.py") if "gpu" not in path.relative_to(root).parts)


def collect(files: list[str]) -> list[str]:
    """The node ids pytest collects from ``files`` (with the project's default markers)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                          cwd=REPO, capture_output=True, text=True)
    ids = [line for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"collecting tests failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return ids


def sample(ids: list[str], count: int, seed: int) -> list[str]:
    """``count`` node ids drawn without replacement with ``seed`` (all of them for 0 or more)."""
    if count <= 0 or count >= len(ids):
        return list(ids)
    return sorted(random.Random(seed).sample(ids, count))


def plain_env() -> dict[str, str]:
    """This process's environment without what a pytest runner sets for its tests (xdist's worker
    variables, the current test): a test run from inside a test -- this tool's own tests in CI --
    must not inherit the runner it is checking independence from."""
    return {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))}


def run_one(target: str, log_dir: Path) -> tuple[str, int, float]:
    """(target, pytest's exit status, seconds) of ``target`` run in a pytest process of its own
    (:func:`plain_env`); the output is kept when it failed."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target],
                          cwd=REPO, capture_output=True, text=True, env=plain_env())
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", target)[:200] + ".log")).write_text(proc.stdout + proc.stderr)
    return target, proc.returncode, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("files", "tests"), help="a process per test file, or per single test")
    parser.add_argument("--sample", type=int, default=100, help="tests mode: how many single tests (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="tests mode: the sample's seed")
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes side by side")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/epas-test-alone"), help="where failures' output goes")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    files = test_files()
    targets = files if args.mode == "files" else sample(collect(files), args.sample, args.seed)
    print(f"{len(targets)} {'files' if args.mode == 'files' else 'tests'}, each in its own pytest process, "
          f"{args.jobs} at a time", flush=True)
    failed = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for done, (target, status, seconds) in enumerate(pool.map(lambda t: run_one(t, args.log_dir), targets), start=1):
            ok = status == 0  # 5 (nothing collected) fails too: an id that collects nothing alone is a finding
            print(f"[{done}/{len(targets)}] {'ok  ' if ok else 'FAIL'} {seconds:6.1f} s {target}", flush=True)
            if not ok:
                failed.append(target)
    print(f"{len(targets) - len(failed)} passed alone, {len(failed)} failed" + (f" (output in {args.log_dir}):" if failed else ""))
    for target in failed:
        print(f"  {target}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
