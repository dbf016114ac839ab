"""Every installed command (``[project.scripts]`` in pyproject.toml) runs as a command: the
console script in the environment's ``bin`` folder starts, parses its flags and refuses a bad
input with exit status 2 and an ``error:`` line naming the flag. Elsewhere the tests call the
commands' ``main`` functions in process; this is the one place the installed scripts run."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from epas_testing import REPO

BIN = Path(sys.executable).parent

REFUSALS = {
    "epas-train": (["--preset", "nope", "--output-dir", "{tmp}/run"], "--preset"),
    "epas-plan": (["--world-size", "0", "--preset", "tiny"], "--world-size must be >= 1"),
    "epas-eval": (["--load", "{tmp}/missing", "--regions", "0"], "missing"),
    "epas-generate": (["--load", "{tmp}/missing", "--prompt", "x"], "missing"),
    "epas-bench": (["train", "--preset", "tiny", "--region", "4"], "--region"),
    "epas-preprocess": (["--input", "{tmp}/missing.jsonl", "--output-prefix", "{tmp}/out", "--tokenizer-model", "{tmp}/t.model"],
                        "--input"),
    "epas-convert": (["hf-import", "--hf-dir", "{tmp}", "--output", "{tmp}/ckpt"], "--hf-dir"),
}


def test_every_installed_command_runs_and_refuses_bad_input(tmp_path):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == set(REFUSALS), "a new command needs a refusal here"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("WORLD_SIZE", None)
    procs = {}
    for name, (argv, _) in REFUSALS.items():  # started together: the interpreters start in parallel
        command = BIN / name
        assert command.is_file(), f"{name} is not installed in {BIN} (pip install -e .)"
        procs[name] = subprocess.Popen([str(command), *(a.format(tmp=tmp_path) for a in argv)], cwd=tmp_path, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2, f"{name}: exit {proc.returncode}\n{err[-2000:]}"
        assert errors and REFUSALS[name][1] in errors[0], f"{name}: {err[-2000:]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refusal wrote something"
