"""slurm/pretrain.sbatch on a real two-node Slurm cluster (CPU, gloo, 1 process per node).

The reference for every job is an independent local run of the same config and seed:
``torchrun --standalone --nproc-per-node 2 -m epas_megatron.train`` (tests/epas_testing.py),
which never goes through the launcher or Slurm. Training on CPU is bit-exact, so the per-
iteration losses of the Slurm jobs (metrics.jsonl) must equal it exactly, including jobs that
were signalled, saved, requeued and resumed.

Two jobs, each run twice by Slurm (started from scratch, preempted, requeued, resumed to the
end): every launch of the batch script (srun -> one launcher per node -> torchrun with c10d on
the allocation's first node -> epas_megatron.train) is checked, the first from scratch and the
last to the end of the run, so no separate uninterrupted job is launched: the losses of all
iterations of both jobs, before and after their preemption, are the reference's.
"""

from __future__ import annotations

import json
import os
import re
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


def submit(cluster, work: Path, name: str, *trainer_args: str, env: dict | None = None) -> tuple[str, Path, Path]:
    """sbatch slurm/pretrain.sbatch on two nodes (``env``: more of the submitting shell's
    environment); returns (job id, output dir, job log)."""
    out = work / "run"
    env = {
        "CONFIG": str(CONFIG),
        "OUTPUT_DIR": str(out),
        "OMP_NUM_THREADS": "1",
        "PYTHON": sys.executable,
        "EPAS_CACHE_DIR": os.environ["EPAS_CACHE_DIR"],
        **(env or {}),
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


SEGMENT = re.compile(r"^=== epas-pretrain job (\d+) \(restart (\d+)\) on (\S+) at ", re.M)


def segments(log_text: str) -> list[tuple[str, int, str, str]]:
    """(job id, restart count, node list, its part of the log) of each run of the batch script,
    in order (a requeued job appends to its log: --open-mode=append)."""
    starts = list(SEGMENT.finditer(log_text))
    ends = [m.start() for m in starts[1:]] + [len(log_text)]
    return [(m[1], int(m[2]), m[3], log_text[m.start():end]) for m, end in zip(starts, ends)]


def assert_one_launcher_per_node(cluster, job: str, log_text: str, restarts: int) -> None:
    """Every run of the batch script: one launcher per node of that run's allocation, c10d
    rendezvous on its first node with the job id, a world of 2 = DP 2. The last run's nodes are
    the ones Slurm reports for the job."""
    runs = segments(log_text)
    assert [(j, r) for j, r, _, _ in runs] == [(job, r) for r in range(restarts + 1)], (runs, log_text[-3000:])
    for _, restart, node_list, text in runs:
        nodes = cluster.command("scontrol", "show", "hostnames", node_list).stdout.split()
        assert len(nodes) == 2, (restart, nodes)
        commands = re.findall(r"^\[launch (\S+)\] command: (.*)$", text, re.M)
        assert sorted(node for node, _ in commands) == sorted(nodes), (restart, nodes, text[-3000:])
        for node, command in commands:
            assert f"--rdzv-backend c10d --rdzv-endpoint {nodes[0]}:" in command, (restart, node, command)
            assert f"--rdzv-id {job} " in command, (restart, node, command)
        assert "world 2 = TP 1 x PP 1 x DP 2" in text, restart
    assert cluster.command("scontrol", "show", "hostnames", runs[-1][2]).stdout.split() == cluster.job_nodes(job)


def preempt_once_training(cluster, submitted: dict, iterations: int) -> None:
    """Preempt each job (:data:`PREEMPTIONS`) as soon as rank 0 logged ``iterations`` training
    steps (both ranks are past setup then), each on its own: one that starts sooner must not
    train to its end while the other one starts."""
    waiting = dict(submitted)

    def preempted_all() -> bool:
        for how, (job, out, _) in list(waiting.items()):
            if len(train_losses(read_metrics(out))) >= iterations:
                if how == "usr1":
                    cluster.command("scancel", "--signal=USR1", job)
                else:
                    cluster.command("scontrol", "requeue", job)
                del waiting[how]
                continue
            state = cluster.job_state(job)
            assert state in ("", "PENDING", "CONFIGURING", "RUNNING"), f"job {job} is {state} before it could be signalled"
        return not waiting

    wait_until(preempted_all, timeout=JOB_TIMEOUT, poll=0.1, what=f"{iterations} logged iterations of every job")


def wait_for_requeue(cluster, job: str) -> None:
    """Until the job has been requeued and runs again (it waits cred_expire seconds first)."""

    def restarted() -> bool:
        info = cluster.job_info(job)
        return info.get("Restarts") == "1" and info.get("JobState") in ("RUNNING", "COMPLETING", "COMPLETED")

    wait_until(restarted, timeout=JOB_TIMEOUT, poll=0.3, what=f"job {job} requeued and running again")


PREEMPTIONS = {"usr1": "signal 10", "requeue": "signal 15"}
"""How a job is preempted -> the exit reason of its first segment's SUMMARY."""

LAUNCH_ENV = {"usr1": {}, "requeue": {"LAUNCH_VALIDATE": "0"}}
"""The USR1 job launches as a user would (the launcher validates the run config, importing
Megatron-Core, on every node before torchrun starts: on a resumed run too); the requeue job skips
that check (LAUNCH_VALIDATE=0, a documented launcher knob; test_launcher.py tests the check), which
saves four Megatron-Core imports on the two shared cores."""


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """The module's two two-node jobs, submitted together so that they run side by side, both
    preempted after 3 logged iterations. USR1 (as --signal=USR1@T sends it): the trainer saves
    and exits 0, the batch script sees the run unfinished and requeues itself. ``scontrol
    requeue`` (what preemption with PreemptMode=REQUEUE does): Slurm sends SIGTERM, the trainer
    saves, Slurm requeues. Each job then resumes and runs to the end.
    {name: (job id, output dir, job log)}; the jobs are cancelled when the module ends."""
    work = tmp_path_factory.mktemp("slurm-jobs")
    try:
        submitted = {}
        for how in PREEMPTIONS:
            (work / how).mkdir()
            submitted[how] = submit(slurm_cluster, work / how, f"epas-b-{how}", env=LAUNCH_ENV[how])
        preempt_once_training(slurm_cluster, submitted, iterations=3)
        yield submitted
    finally:
        slurm_cluster.cancel_all()


@pytest.fixture(scope="module")
def reference(jobs, tmp_path_factory):
    """The uninterrupted local run (2 processes, never through the launcher or Slurm) of the same
    config; it trains while the jobs wait out their requeue (after they were preempted: its CPU
    time would delay their signals past the end of training)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run = run_trainer(["--config", str(CONFIG), *ARGS], out, nproc=2, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert switch_iterations(run.metrics) == SWITCHES
    losses = train_losses(run.metrics)
    assert sorted(losses) == list(range(1, TRAIN_ITERS + 1))
    return losses


@pytest.fixture(scope="module")
def finished(slurm_cluster, jobs, reference):
    """The jobs, once requeued and run to the end (the reference trained meanwhile)."""
    for job, _, _ in jobs.values():
        wait_for_requeue(slurm_cluster, job)
    slurm_cluster.wait_for([job for job, _, _ in jobs.values()], timeout=JOB_TIMEOUT)
    return jobs


def test_two_node_job_matches_local_torchrun(slurm_cluster, finished, reference):
    """Every launch of both jobs: one launcher per node, c10d rendezvous on the first node of
    that launch's allocation; the finished run has the reference's losses at every iteration,
    its switches and its final checkpoint; its last segment completed and was not requeued again."""
    cluster = slurm_cluster  # not the `cluster` fixture: it cancels every job, this module's included, when a test ends
    for how, (job, out, log) in finished.items():
        assert_completed(cluster, job, log, restarts=1)
        text = job_log(log)
        assert_one_launcher_per_node(cluster, job, text, restarts=1)
        assert [s["exit_reason"] for s in summaries(text)][-1:] == ["completed"], (how, text[-3000:])

        metrics = read_metrics(out)
        assert switch_iterations(metrics) == SWITCHES, how
        assert train_losses(metrics) == reference, how
        assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(TRAIN_ITERS), how


def test_preempted_jobs_resume_to_the_same_losses(slurm_cluster, finished, reference):
    """Either way of preemption (:func:`jobs`), the requeued job resumes from
    <output-dir>/checkpoints and ends where an uninterrupted run ends."""
    cluster = slurm_cluster
    for how, (job, out, log) in finished.items():
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
