"""slurm/pretrain.sbatch on a real two-node Slurm cluster (CPU, gloo, 1 process per node).

The reference for every job is an independent local run of the same config and seed:
``torchrun --standalone --nproc-per-node 2 -m epas_megatron.train`` (tests/epas_testing.py),
which never goes through the launcher or Slurm. Training on CPU is bit-exact, so the per-
iteration losses of the Slurm jobs (metrics.jsonl) must equal it exactly, including jobs that
were signalled, saved, requeued and resumed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_slurm import wait_until  # noqa: E402

from epas_testing import read_metrics, run_trainer  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.distributed, pytest.mark.cpu_only]  # CPU, gloo: bit-exact references

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "launch" / "configs" / "tiny.yaml"
TRAIN_ITERS = 100
SWITCHES = [20, 40]  # --epas-interval 20 with tiny.yaml's target 0.5 (2 of 4 layers), growth 1
ARGS = ["--train-iters", str(TRAIN_ITERS), "--epas-interval", "20", "--eval-interval", "0", "--log-interval", "1", "--no-tensorboard",
        "--seed", "1234"]
JOB_TIMEOUT = 240


def train_losses(metrics: list[dict]) -> dict[int, float]:
    records = [m for m in metrics if "kind" not in m]
    iterations = [m["iteration"] for m in records]
    assert len(iterations) == len(set(iterations)), f"iterations logged twice: {sorted(iterations)}"
    return {m["iteration"]: m["lm_loss"] for m in records}


def switch_iterations(metrics: list[dict]) -> list[int]:
    return [m["iteration"] for m in metrics if m.get("kind") == "switch"]


def submit(cluster, work: Path, name: str, *trainer_args: str) -> tuple[str, Path, Path]:
    """sbatch slurm/pretrain.sbatch on two nodes; returns (job id, output dir, job log)."""
    out = work / "run"
    env = {
        "CONFIG": str(CONFIG),
        "OUTPUT_DIR": str(out),
        "OMP_NUM_THREADS": "1",
        "PYTHON": sys.executable,
        "EPAS_CACHE_DIR": os.environ["EPAS_CACHE_DIR"],
    }
    result = cluster.command(
        "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--time=15", f"--job-name={name}",
        f"--output={work}/%x-%j.out", str(REPO / "slurm" / "pretrain.sbatch"), *ARGS, *trainer_args,
        cwd=REPO, env=env,
    )
    job = result.stdout.strip().split(";")[0]
    return job, out, work / f"{name}-{job}.out"


def job_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else f"(no job log {path})"


def assert_completed(cluster, job: str, log: Path, restarts: int) -> None:
    info = cluster.job_info(job)
    tail = job_log(log)[-3000:] + f"\n--- scontrol: {info}\n--- daemons:\n{cluster.daemon_log(job)}"
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (
        f"job {job}: {info.get('JobState')} {info.get('ExitCode')}\n{tail}")
    assert info.get("Restarts") == str(restarts), f"job {job} restarted {info.get('Restarts')} times, expected {restarts}\n{tail}"


def summaries(log_text: str) -> list[dict]:
    return [json.loads(line.split("SUMMARY ", 1)[1]) for line in log_text.splitlines() if line.startswith("SUMMARY ")]


def wait_for_training(out: Path, cluster, job: str, iterations: int) -> None:
    """Until rank 0 logged ``iterations`` training steps (both ranks are past setup then)."""

    def trained() -> bool:
        if len(train_losses(read_metrics(out))) >= iterations:
            return True
        state = cluster.job_state(job)
        assert state in ("", "PENDING", "CONFIGURING", "RUNNING"), f"job {job} is {state} before it could be signalled"
        return False

    wait_until(trained, timeout=JOB_TIMEOUT, poll=0.1, what=f"{iterations} logged iterations")


def wait_for_requeue(cluster, job: str) -> None:
    """Until the job has been requeued and runs again (it waits cred_expire seconds first)."""

    def restarted() -> bool:
        info = cluster.job_info(job)
        return info.get("Restarts") == "1" and info.get("JobState") in ("RUNNING", "COMPLETING", "COMPLETED")

    wait_until(restarted, timeout=JOB_TIMEOUT, poll=0.3, what=f"job {job} requeued and running again")


PREEMPTIONS = {"usr1": "signal 10", "requeue": "signal 15"}
"""How a job is preempted -> the exit reason of its first segment's SUMMARY."""


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """The module's three two-node jobs, submitted together so that they run side by side on
    the six nodes: a plain one ("plain"), and two preempted after 3 logged iterations. USR1 (as
    --signal=USR1@T sends it): the trainer saves and exits 0, the batch script sees the run
    unfinished and requeues itself. ``scontrol requeue`` (what preemption with
    PreemptMode=REQUEUE does): Slurm sends SIGTERM, the trainer saves, Slurm requeues.
    {name: (job id, output dir, job log)}; the jobs are cancelled when the module ends."""
    work = tmp_path_factory.mktemp("slurm-jobs")
    names = {"plain": "epas-a", **{how: f"epas-b-{how}" for how in PREEMPTIONS}}
    try:
        submitted = {}
        for key, name in names.items():
            (work / key).mkdir()
            submitted[key] = submit(slurm_cluster, work / key, name)
        for how in PREEMPTIONS:
            job, out, _ = submitted[how]
            wait_for_training(out, slurm_cluster, job, iterations=3)
            if how == "usr1":
                slurm_cluster.command("scancel", "--signal=USR1", job)
            else:
                slurm_cluster.command("scontrol", "requeue", job)
        yield submitted
    finally:
        slurm_cluster.cancel_all()


@pytest.fixture(scope="module")
def reference(jobs, tmp_path_factory):
    """The uninterrupted local run (2 processes, never through the launcher or Slurm) of the same
    config; it trains while the jobs run (after they were preempted: its CPU time would delay
    their signals past the end of training)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run = run_trainer(["--config", str(CONFIG), *ARGS], out, nproc=2, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert switch_iterations(run.metrics) == SWITCHES
    losses = train_losses(run.metrics)
    assert sorted(losses) == list(range(1, TRAIN_ITERS + 1))
    return losses


def test_two_node_job_matches_local_torchrun(slurm_cluster, jobs, reference):
    cluster = slurm_cluster  # not the `cluster` fixture: it cancels every job, this module's included, when a test ends
    job, out, log = jobs["plain"]
    cluster.wait_for([job], timeout=JOB_TIMEOUT)
    assert_completed(cluster, job, log, restarts=0)
    text = job_log(log)

    # One launcher per node, c10d rendezvous on the first node of the allocation.
    nodes = cluster.job_nodes(job)
    assert len(nodes) == 2, nodes
    first = nodes[0]
    for node in nodes:
        assert f"[launch {node}] command: " in text, text[-3000:]
    assert f"--rdzv-backend c10d --rdzv-endpoint {first}:" in text
    assert f"--rdzv-id {job}" in text
    assert "world 2 = TP 1 x PP 1 x DP 2" in text
    assert [s["exit_reason"] for s in summaries(text)] == ["completed"]

    metrics = read_metrics(out)
    assert switch_iterations(metrics) == SWITCHES
    assert train_losses(metrics) == reference
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS)


def test_preempted_jobs_resume_to_the_same_losses(slurm_cluster, jobs, reference):
    """Either way of preemption (:func:`jobs`), the requeued job resumes from
    <output-dir>/checkpoints and ends where an uninterrupted run ends."""
    cluster = slurm_cluster
    preempted = {how: jobs[how] for how in PREEMPTIONS}
    for job, _, _ in preempted.values():
        wait_for_requeue(cluster, job)
    cluster.wait_for([job for job, _, _ in preempted.values()], timeout=JOB_TIMEOUT)

    for how, (job, out, log) in preempted.items():
        assert_completed(cluster, job, log, restarts=1)
        text = job_log(log)
        runs = summaries(text)
        assert [s["exit_reason"] for s in runs] == [PREEMPTIONS[how], "completed"], (how, text[-4000:])
        stopped_at = runs[0]["iterations"]
        assert 3 <= stopped_at < TRAIN_ITERS, how
        assert f"resumed from {out}/checkpoints/iter_{stopped_at:07d} at iteration {stopped_at}" in text
        assert runs[1]["iterations_this_run"] == TRAIN_ITERS - stopped_at
        if how == "usr1":
            assert "not finished: requeueing job" in text
            assert "forwarded SIGUSR1" in text

        metrics = read_metrics(out)
        losses = train_losses(metrics)  # each iteration exactly once across both segments
        assert sorted(losses) == list(range(1, TRAIN_ITERS + 1)), how
        assert losses == reference, how
        assert switch_iterations(metrics) == SWITCHES, how  # logged by whichever segment crossed them
