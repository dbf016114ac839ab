"""launch/launch.py without Slurm: command construction, environment defaults, bad input.

Fake ``nvidia-smi`` and ``scontrol`` executables on a private PATH stand in for GPUs and for
Slurm's hostname expansion. The bad-input cases run the real ``launch/run_train.sh`` and check
that it stops with ``error: ...`` and exit status 2 before torchrun starts.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "run_train.sh"
TINY = REPO / "launch" / "configs" / "tiny.yaml"


def _load_launcher():
    spec = importlib.util.spec_from_file_location("epas_launch", REPO / "launch" / "launch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["epas_launch"] = module
    spec.loader.exec_module(module)
    return module


launch = _load_launcher()


def write_exe(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_bin(tmp_path) -> Path:
    """An empty directory used as PATH (add fakes with write_exe)."""
    d = tmp_path / "bin"
    d.mkdir()
    return d


def fake_gpus(bin_dir: Path, count: int) -> None:
    lines = "\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})" for i in range(count))
    write_exe(bin_dir, "nvidia-smi", f'[ "$1" = "-L" ] || exit 9\ncat <<EOF\n{lines}\nEOF\n')


def fake_scontrol(bin_dir: Path, nodelist: str, hosts: list[str]) -> None:
    """scontrol that only answers 'show hostnames <nodelist>'."""
    write_exe(bin_dir, "scontrol", f'[ "$1 $2 $3" = "show hostnames {nodelist}" ] || {{ echo "unexpected: $*" >&2; exit 1; }}\n'
                                   f'printf "%s\\n" {" ".join(hosts)}\n')


def slurm_step_env(bin_dir: Path, nodes: int, node_id: int, nodelist: str, job: str = "4242", tasks: int | None = None) -> dict:
    """The variables srun sets in a job step (one task per node unless ``tasks``)."""
    return {
        "PATH": str(bin_dir),
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(tasks or nodes),
        "SLURM_NTASKS": str(tasks or nodes),
        "SLURM_NODEID": str(node_id),
        "SLURMD_NODENAME": f"node{node_id}",
    }


def tail_after_module(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("-m"):]


# ------------------------------------------------------------------------- command construction
def test_single_node_cpu(fake_bin):
    spec = launch.make_launch_spec(["--train-iters", "5"], {"PATH": str(fake_bin), "CONFIG": "launch/configs/tiny.yaml"}, cwd=REPO)
    assert (spec.nnodes, spec.nproc_per_node, spec.gpus, spec.rendezvous) == (1, launch.CPU_PROCESSES_PER_NODE, 0, None)
    cmd = launch.torchrun_command(spec)
    prefix = len(spec.torchrun)
    assert cmd[prefix:prefix + 3] == ["--standalone", "--nnodes", "1"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "1"
    assert tail_after_module(cmd) == ["-m", "epas_megatron.train", "--config", str(TINY), "--train-iters", "5"]
    assert spec.env_defaults["OMP_NUM_THREADS"] == str(max(1, launch.cpus_available() // 1))
    assert not any(k.startswith(("NCCL", "CUDA")) for k in spec.env_defaults)


def test_config_by_name_and_overrides(fake_bin):
    env = {"PATH": str(fake_bin), "CONFIG": "tiny", "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "3", "TORCHRUN_ARGS": "--log-dir /tmp/x"}
    spec = launch.make_launch_spec([], env, cwd=Path("/"))
    assert spec.config == TINY and spec.nproc_per_node == 2
    assert "OMP_NUM_THREADS" not in spec.env_defaults  # the user's value stays
    cmd = launch.torchrun_command(spec)
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--log-dir") + 1] == "/tmp/x" and cmd.index("--log-dir") < cmd.index("-m")


def test_gpu_node_uses_every_visible_gpu(fake_bin):
    fake_gpus(fake_bin, 8)
    spec = launch.make_launch_spec([], {"PATH": str(fake_bin)})
    assert (spec.gpus, spec.nproc_per_node) == (8, 8)
    assert spec.env_defaults["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert {"NCCL_DEBUG", "NCCL_IB_TIMEOUT", "TORCH_NCCL_AVOID_RECORD_STREAMS"} <= set(spec.env_defaults)
    assert spec.env_defaults["OMP_NUM_THREADS"] == str(max(1, launch.cpus_available() // 8))
    spec = launch.make_launch_spec([], {"PATH": str(fake_bin), "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_DEBUG": "INFO"})
    assert spec.nproc_per_node == 2 and "NCCL_DEBUG" not in spec.env_defaults
    with pytest.raises(launch.LaunchError, match="NPROC_PER_NODE=16 but this node has 8 GPU"):
        launch.make_launch_spec([], {"PATH": str(fake_bin), "NPROC_PER_NODE": "16"})


@pytest.mark.parametrize("backend", ["c10d", "static"])
def test_slurm_multi_node(fake_bin, backend):
    fake_gpus(fake_bin, 8)
    fake_scontrol(fake_bin, "gpu[01-04]", ["gpu01", "gpu02", "gpu03", "gpu04"])
    env = {**slurm_step_env(fake_bin, nodes=4, node_id=2, nodelist="gpu[01-04]"), "RDZV_BACKEND": backend}
    spec = launch.make_launch_spec(["--train-iters", "10"], env)
    assert (spec.nnodes, spec.nproc_per_node, spec.node_rank, spec.world_size) == (4, 8, 2, 32)
    assert (spec.rendezvous.host, spec.rendezvous.port) == ("gpu01", launch.RDZV_PORT_BASE + 4242)
    cmd = launch.torchrun_command(spec)
    rdzv = cmd[len(spec.torchrun):cmd.index("--nproc-per-node")]
    if backend == "c10d":
        assert rdzv == ["--nnodes", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu01:24242", "--rdzv-id", "4242"]
    else:
        assert rdzv == ["--nnodes", "4", "--node-rank", "2", "--master-addr", "gpu01", "--master-port", "24242"]
    assert tail_after_module(cmd) == ["-m", "epas_megatron.train", "--train-iters", "10"]
    env["RDZV_PORT"] = "31111"
    assert launch.make_launch_spec([], env).rendezvous.port == 31111


def test_slurm_single_node_job_is_standalone(fake_bin):
    env = slurm_step_env(fake_bin, nodes=1, node_id=0, nodelist="cpu7")
    spec = launch.make_launch_spec([], env)
    assert spec.rendezvous is None and "--standalone" in launch.torchrun_command(spec)


def test_multi_node_without_slurm(fake_bin):
    spec = launch.make_launch_spec([], {"PATH": str(fake_bin), "NNODES": "2", "NODE_RANK": "1", "RDZV_HOST": "head"})
    assert (spec.nnodes, spec.node_rank, spec.rendezvous.host, spec.rendezvous.port) == (2, 1, "head", launch.DEFAULT_RDZV_PORT)
    with pytest.raises(launch.LaunchError, match="needs NODE_RANK"):
        launch.make_launch_spec([], {"PATH": str(fake_bin), "NNODES": "2"})


def test_slurm_misuse_is_reported(fake_bin):
    fake_scontrol(fake_bin, "n[1-2]", ["n1", "n2"])
    batch = {k: v for k, v in slurm_step_env(fake_bin, 2, 0, "n[1-2]").items() if "STEP" not in k}
    with pytest.raises(launch.LaunchError, match="does not run in a job step.*srun --ntasks-per-node=1"):
        launch.make_launch_spec([], batch)
    with pytest.raises(launch.LaunchError, match="runs 4 tasks on 2 nodes"):
        launch.make_launch_spec([], slurm_step_env(fake_bin, 2, 0, "n[1-2]", tasks=4))
    with pytest.raises(launch.LaunchError, match="NNODES=3 but this Slurm job step runs on 2"):
        launch.make_launch_spec([], {**slurm_step_env(fake_bin, 2, 0, "n[1-2]"), "NNODES": "3"})
    with pytest.raises(launch.LaunchError, match="NPROC_PER_NODE='two' is not an integer"):
        launch.make_launch_spec([], {"PATH": str(fake_bin), "NPROC_PER_NODE": "two"})


# ------------------------------------------------------------------------- the script, bad input
@pytest.fixture(autouse=True)
def no_gpus_here(fake_bin):
    """A failing nvidia-smi first on PATH: the script tests see no GPU even on a GPU machine."""
    write_exe(fake_bin, "nvidia-smi", "exit 1\n")


def run_script(args, env_extra, timeout=120):
    """launch/run_train.sh with a clean launcher environment (no Slurm, no launcher knobs). GPUs
    are hidden (``CUDA_VISIBLE_DEVICES=``): these tests take the CPU launch path on any machine,
    a GPU node included (the GPU path is planned above with a fake nvidia-smi)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "NPROC", "NNODES", "NODE_RANK", "RDZV_", "CONFIG", "DRY_RUN", "LAUNCH_"))}
    env.update(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", **env_extra)
    env.setdefault("PATH", os.environ["PATH"])
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_dry_run_prints_the_exact_command(tmp_path, fake_bin):
    env = {"CONFIG": "launch/configs/tiny.yaml", "NPROC_PER_NODE": "2", "DRY_RUN": "1", "LAUNCH_VALIDATE": "0",
           "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    out = tmp_path / "never"
    proc = run_script(["--train-iters", "3", "--output-dir", str(out)], env)
    assert proc.returncode == 0, proc.stderr
    printed = [l for l in proc.stdout.splitlines() if l.startswith("[launch] command: ")]
    assert len(printed) == 1
    cmd = shlex.split(printed[0][len("[launch] command: "):])
    assert cmd[-6:] == ["--config", str(TINY), "--train-iters", "3", "--output-dir", str(out)]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and "--standalone" in cmd
    assert Path(cmd[0]).name == "torchrun" or cmd[1:3] == ["-m", "torch.distributed.run"]
    assert not out.exists()


def test_missing_config(fake_bin):
    proc = run_script([], {"CONFIG": "launch/configs/nope.yaml", "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: CONFIG=launch/configs/nope.yaml: no such config file")
    assert "tiny" in proc.stderr and "7b" in proc.stderr  # lists what exists
    assert "command:" not in proc.stdout


@pytest.mark.parametrize(
    "config, nproc, args, message",
    [
        ("7b", "2", [], "preset 7b with --tp 2 x --pp 2 = 4 does not divide the world of 1 node(s) x 2 process(es) per node = 2 processes"),
        ("tiny", "3", ["--tp", "2"], "--tp 2 x --pp 1 = 2 does not divide the world of 1 node(s) x 3 process(es) per node = 3 processes"),
    ],
)
def test_parallel_layout_that_does_not_fit(tmp_path, fake_bin, config, nproc, args, message):
    out = tmp_path / "run"
    proc = run_script([*args, "--output-dir", str(out)],
                      {"CONFIG": config, "NPROC_PER_NODE": nproc, "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "command:" not in proc.stdout and not out.exists()


def test_trainer_validation_runs_before_launch(tmp_path, fake_bin):
    """The trainer's own checks (here: KV groups vs TP) fail in the launcher, not in torchrun."""
    out = tmp_path / "run"
    proc = run_script(["--tp", "2", "--num-query-groups", "1", "--output-dir", str(out)],
                      {"CONFIG": "tiny", "NPROC_PER_NODE": "2", "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert proc.returncode == 2
    assert "--num-query-groups 1 is not divisible by --tp 2" in proc.stderr
    assert "command:" not in proc.stdout and not out.exists()


def test_rendezvous_host_that_does_not_resolve(fake_bin):
    fake_scontrol(fake_bin, "n[1-2]", ["epas-no-such-host.invalid", "n2"])
    env = {**slurm_step_env(fake_bin, 2, 1, "n[1-2]"), "PATH": f"{fake_bin}:{os.environ['PATH']}", "LAUNCH_VALIDATE": "0"}
    proc = run_script([], env)
    assert proc.returncode == 2
    assert "error: rendezvous host 'epas-no-such-host.invalid' does not resolve" in proc.stderr


def test_rendezvous_port_that_nobody_opens(fake_bin):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends
    env = {**slurm_step_env(fake_bin, 2, 1, "n[1-2]"), "PATH": f"{fake_bin}:{os.environ['PATH']}", "LAUNCH_VALIDATE": "0",
           "RDZV_HOST": "127.0.0.1", "RDZV_PORT": str(port), "RDZV_CHECK_TIMEOUT": "1.5"}
    proc = run_script([], env)  # (its own timeout catches a check that never gives up)
    assert proc.returncode == 2
    # The message names the timeout it waited, so a check that ignored RDZV_CHECK_TIMEOUT fails here.
    assert f"error: rendezvous host 127.0.0.1:{port} is not reachable from node1 (node rank 1) after 1.5s" in proc.stderr


def test_node_zero_must_be_the_rendezvous_host(fake_bin):
    fake_scontrol(fake_bin, "n[1-2]", ["192.0.2.7", "n2"])  # TEST-NET-1: never an address of this machine
    env = {**slurm_step_env(fake_bin, 2, 0, "n[1-2]"), "PATH": f"{fake_bin}:{os.environ['PATH']}", "LAUNCH_VALIDATE": "0"}
    proc = run_script([], env)
    assert proc.returncode == 2
    assert "is not an address of this machine" in proc.stderr


# ------------------------------------------------------------------------- a real launch
@pytest.mark.distributed
@pytest.mark.parametrize("when", ["training", "setup"])
def test_usr1_to_the_launcher_saves_and_exits_cleanly(tmp_path, fake_bin, when):
    """Outside Slurm: SIGUSR1 to the launcher alone reaches both workers (forwarded), torchrun
    survives it, the trainer saves at the iteration it stopped and everything exits 0. Sent
    while the workers are still importing (``setup``: they ignore SIGUSR1 until the trainer
    installs its handler), it is repeated until it takes effect."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "CONFIG": "tiny", "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1", "LAUNCH_VALIDATE": "0",
           "PATH": f"{fake_bin}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""}  # two CPU workers on any machine
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    iters = 3000
    args = ["--train-iters", str(iters), "--eval-interval", "0", "--log-interval", "1", "--no-tensorboard", "--output-dir", str(out)]
    proc = subprocess.Popen(["bash", str(SCRIPT), *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    head = []
    try:
        if when == "setup":
            for line in proc.stdout:  # the launcher prints the command just before starting torchrun
                head.append(line)
                if line.startswith("[launch] command: "):
                    break
            # Sent as torchrun starts (no sleep: the launcher keeps a signal that arrives before
            # its workers exist and repeats it until the trainer's handler takes it).
            assert not (out / "metrics.jsonl").exists(), "too late: training already started"
        else:
            metrics = out / "metrics.jsonl"
            deadline = time.monotonic() + 180
            while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
                assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
                time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        output, _ = proc.communicate(timeout=180)
        output = "".join(head) + output
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    summary = [l for l in output.splitlines() if l.startswith("SUMMARY ")]
    assert len(summary) == 1 and '"exit_reason": "signal 10"' in summary[0], output[-3000:]
    assert "[launch] forwarded SIGUSR1 to the trainer processes; torchrun exited with 0" in output
    saved = int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= saved < iters
    if when == "training":
        assert saved >= 3
