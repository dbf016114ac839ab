"""A real multi-node Slurm cluster on this machine, in a temporary directory (for tests).

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (Slurm 22.05) run without
systemd: a private ``munged`` (own key, socket and pid file, as user munge), ``slurmctld -f
CONF`` and one ``slurmd -f CONF -N <node>`` per node (multiple-slurmd build: each node has its own port,
spool, log and pid file). The node names (``epas-n1`` ... ``epas-n6``) are added to /etc/hosts for
the cluster's lifetime, pointing at 127.0.0.1, so that ``scontrol show hostnames`` yields names
that resolve as on a real cluster. :meth:`LocalSlurmCluster.stop` cancels the cluster's jobs,
stops exactly the daemons it started (by their pid files) and removes its /etc/hosts line.

    python tests/launch/local_slurm.py            # bring one up by hand; Ctrl-C stops it
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged")
NODES = tuple(f"epas-n{i}" for i in range(1, 7))
"""Six nodes: the two two-node jobs of test_slurm_pretrain (with room for a requeued one to start
on other nodes) or the sweep's three one-node points run side by side, so their start-ups and the
requeues' cred_expire waits overlap. Every node is a slurmd on this machine (NodeAddr 127.0.0.1)."""
HOSTS_FILE = Path("/etc/hosts")
CRED_EXPIRE_S = 5
"""Requeued jobs start again after about this many seconds (slurm.conf AuthInfo cred_expire)."""
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
"""Job states after which a job will not run again (without a requeue)."""


class ClusterUnavailable(Exception):
    """Slurm cannot run here; the message says why (tests skip with it)."""


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def ensure_slurm_installed() -> None:
    """Install the Debian packages if a binary is missing; ClusterUnavailable if impossible."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("needs root (munged runs as user munge, slurmd as root, /etc/hosts gets the node names)")
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"Slurm binaries {missing} are missing and apt-get is not available to install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:  # stale or missing package lists: refresh once
        subprocess.run(["apt-get", "update"], capture_output=True, text=True, env=env, timeout=600)
        result = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if result.returncode != 0 or missing:
        raise ClusterUnavailable(f"'{' '.join(install)}' failed (exit {result.returncode}): {result.stderr.strip()[-500:]}")


class LocalSlurmCluster:
    """slurmctld + one slurmd per node of :data:`NODES` + munged under one temporary directory."""

    def __init__(self, root: Optional[Path] = None, cpus_per_node: Optional[int] = None):
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="epas-slurm-"))
        self.cpus = cpus_per_node or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.nodes = NODES
        self.hosts_line: Optional[str] = None
        self.started: list[tuple[str, Path]] = []  # (name, pid file), in start order
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ start
    def start(self) -> "LocalSlurmCluster":
        try:
            self.root.chmod(0o755)  # munged (user munge) must traverse to its socket
            self._start_munged()
            self._add_hosts()
            self._write_conf()
            self._run(["slurmctld", "-f", str(self.conf)], "slurmctld", self.root / "slurmctld.pid")
            for node in self.nodes:
                self._run(["slurmd", "-f", str(self.conf), "-N", node], f"slurmd {node}", self.root / f"slurmd-{node}.pid")
            self._wait_idle(timeout=60)
        except BaseException:
            self.stop()
            raise
        return self

    def _run(self, cmd: list[str], name: str, pid_file: Path) -> None:
        result = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=60)
        if result.returncode != 0:
            raise ClusterUnavailable(f"{name} did not start (exit {result.returncode}): {result.stderr.strip()[-500:]}; "
                                     f"logs in {self.root / 'log'}")
        deadline = time.monotonic() + 15
        while not pid_file.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        if not pid_file.is_file():
            raise ClusterUnavailable(f"{name} wrote no pid file {pid_file}; logs in {self.root / 'log'}")
        self.started.append((name, pid_file))

    def _start_munged(self) -> None:
        try:
            munge = pwd.getpwnam("munge")
        except KeyError:
            raise ClusterUnavailable("user 'munge' does not exist (the munge package creates it)") from None
        base = self.root / "munge"
        private, run = base / "etc", base / "run"
        for d, mode in ((base, 0o755), (private, 0o700), (run, 0o755)):
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, munge.pw_uid, munge.pw_gid)
            d.chmod(mode)
        key = private / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chown(key, munge.pw_uid, munge.pw_gid)
        key.chmod(0o400)
        self.munge_socket = run / "munge.socket"
        pid_file = run / "munged.pid"
        cmd = [
            "munged", f"--key-file={key}", f"--socket={self.munge_socket}", f"--pid-file={pid_file}",
            f"--log-file={base / 'munged.log'}", f"--seed-file={private / 'munged.seed'}",
        ]

        def as_munge():
            os.setgid(munge.pw_gid)
            os.setgroups([])
            os.setuid(munge.pw_uid)

        result = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=as_munge, timeout=60)
        if result.returncode != 0:
            raise ClusterUnavailable(f"munged did not start: {result.stderr.strip()[-500:]}")
        deadline = time.monotonic() + 10
        while not pid_file.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.started.append(("munged", pid_file))

    def _add_hosts(self) -> None:
        # Always our own line (marked with our directory), even if the names resolve already:
        # another cluster's line may disappear while this one runs.
        self.hosts_line = f"127.0.0.1 {' '.join(self.nodes)}  # epas-megatron test cluster {self.root}\n"
        text = HOSTS_FILE.read_text()
        with open(HOSTS_FILE, "a") as f:
            f.write(("" if not text or text.endswith("\n") else "\n") + self.hosts_line)

    def _write_conf(self) -> None:
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(exist_ok=True)
        host = socket.gethostname()
        node_lines = "\n".join(
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} State=UNKNOWN"
            for node, port in zip(self.nodes, node_ports)
        )
        self.conf.write_text(
            f"""# epas-megatron test cluster (tests/launch/local_slurm.py)
ClusterName=epastest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long slurmd remembers revoked job credentials, which is also how long a
# requeued job waits before it may start again (default 120 s; starting it earlier fails with
# "Job credential revoked").
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# Scheduling passes every 2 s (default 60/30 s): a requeued job starts soon after it may.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
ReturnToService=2
KillWait=15
MinJobAge=3600
SlurmctldTimeout=30
SlurmdTimeout=120
InactiveLimit=0
{node_lines}
PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=self.env, timeout=30)
            out = result.stdout.strip()
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if all(states.get(node) == "idle" for node in self.nodes):
                return
            time.sleep(0.3)
        raise ClusterUnavailable(f"nodes did not become idle within {timeout:.0f}s (sinfo: {out!r}); logs in {self.root / 'log'}")

    # ------------------------------------------------------------------ use
    def command(self, *args: str, check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        env = {**self.env, **kwargs.pop("env", {})}
        result = subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=timeout, **kwargs)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, ...); {} if
        scontrol failed (slurmctld busy: callers poll again)."""
        result = self.command("scontrol", "show", "job", "-o", str(job_id), check=False)
        info = {}
        if result.returncode != 0:
            return info
        for token in result.stdout.split():
            if "=" in token:
                key, _, value = token.partition("=")
                info.setdefault(key, value)
        return info

    def job_nodes(self, job_id: str) -> list[str]:
        """The nodes a job runs (or ran) on, expanded (``epas-n[1-2]`` -> both names)."""
        node_list = self.job_info(job_id).get("NodeList", "")
        return self.command("scontrol", "show", "hostnames", node_list).stdout.split() if node_list else []

    def job_state(self, job_id: str) -> str:
        """JobState from scontrol (PENDING, RUNNING, COMPLETED, ...; '' when unknown)."""
        return self.job_info(job_id).get("JobState", "")

    def wait_for(self, job_ids, timeout: float, poll: float = 0.5) -> None:
        """Poll scontrol until every job of ``job_ids`` is in a final state. (squeue is not
        enough: it prints nothing both for finished jobs and when slurmctld is too busy.)"""
        deadline = time.monotonic() + timeout
        states = {}
        while time.monotonic() < deadline:
            states = {str(j): self.job_state(j) for j in job_ids}
            if all(state in FINAL_STATES for state in states.values()):
                return
            time.sleep(poll)
        raise TimeoutError(f"jobs not finished after {timeout:.0f}s: {states}")

    def daemon_log(self, job_id: str, lines: int = 40) -> str:
        """The slurmctld/slurmd log lines that mention a job (for assertion messages)."""
        pattern = re.compile(rf"(JobId={job_id}\b|\[{job_id}[.\]]|job {job_id}\b|StepId={job_id}\b)")
        found = []
        for log in sorted((self.root / "log").glob("*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if pattern.search(line):
                    found.append(f"{log.stem}: {line}")
        return "\n".join(found[-lines:])

    def cancel_all(self) -> None:
        """Cancel every job of this cluster and wait (briefly) until the queue is empty."""
        self.command("scancel", "--user", pwd.getpwuid(os.geteuid()).pw_name, check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = self.command("squeue", "-h", "-o", "%i", check=False).stdout.strip()
            if not out:
                return
            time.sleep(0.5)

    # ------------------------------------------------------------------ stop
    def stop(self, remove: bool = True) -> None:
        """Cancel jobs, stop the daemons this object started (pid files), undo /etc/hosts."""
        if any(name == "slurmctld" for name, _ in self.started):
            try:
                self.cancel_all()
            except Exception:
                pass
        _stop_pid_files([pid_file for _, pid_file in reversed(self.started)])
        self.started.clear()
        if self.hosts_line is not None:
            try:
                lines = HOSTS_FILE.read_text().splitlines(keepends=True)
                HOSTS_FILE.write_text("".join(line for line in lines if line != self.hosts_line))
            except OSError:
                pass
            self.hosts_line = None
        if remove and os.environ.get("EPAS_KEEP_SLURM_DIR") != "1":
            shutil.rmtree(self.root, ignore_errors=True)


def wait_until(predicate, timeout: float, poll: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy (returned); TimeoutError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what} not reached within {timeout:.0f}s")


def _stop_pid_files(pid_files: list[Path], timeout: float = 15) -> None:
    """SIGTERM to every process of ``pid_files`` at once, then wait for all of them (SIGKILL to
    those still running after ``timeout``): slurmd takes seconds to exit, one after the other
    would add up."""
    pids = []
    for pid_file in pid_files:
        try:
            pid = int(pid_file.read_text().strip())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):  # no pid file, or the process is gone
            continue
        pids.append(pid)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _running(pid)]
        if pids:
            time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    ensure_slurm_installed()
    cluster = LocalSlurmCluster().start()
    print(f"export SLURM_CONF={cluster.conf}   # Ctrl-C stops the cluster")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
