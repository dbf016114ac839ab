"""Turn a run config into the right ``torchrun`` call and run it (``launch/run_train.sh``).

Usage (arguments go to the trainer; the launcher is configured by environment variables, as
torchtitan's ``run_train.sh`` and Megatron-LM's example scripts are)::

    CONFIG=launch/configs/tiny.yaml NPROC_PER_NODE=2 launch/run_train.sh --train-iters 50
    srun --ntasks-per-node=1 launch/run_train.sh --output-dir runs/x   # one launcher per node

Where the world comes from:

* **Single node** (no Slurm allocation of several nodes, ``NNODES`` unset or 1):
  ``torchrun --standalone --nnodes 1 --nproc-per-node N`` with ``N`` = ``NPROC_PER_NODE``, else
  the GPUs ``nvidia-smi`` lists (capped by ``CUDA_VISIBLE_DEVICES``), else
  :data:`CPU_PROCESSES_PER_NODE`.
* **Multi-node under Slurm** (run by ``srun`` with one task per node): the nodes are
  ``scontrol show hostnames $SLURM_JOB_NODELIST``; the rendezvous host is the first of them,
  ``--nnodes $SLURM_NNODES``, and either c10d rendezvous (default: ``--rdzv-backend c10d
  --rdzv-endpoint HOST:PORT --rdzv-id $SLURM_JOB_ID``) or static (``RDZV_BACKEND=static``:
  ``--node-rank $SLURM_NODEID --master-addr HOST --master-port PORT``).
* **Multi-node without Slurm**: ``NNODES``, ``NODE_RANK`` and ``RDZV_HOST`` on every node.

Before anything starts, the launcher checks what it can and stops with ``error: ...`` (exit 2):
a missing config file, a config the trainer rejects for this world size (TP x PP must divide
nodes x processes per node, heads divisible by TP, ...), more processes than GPUs, a rendezvous
host that does not resolve, is not this machine on node 0, or cannot be reached from the other
nodes within ``RDZV_CHECK_TIMEOUT`` seconds.

Signals: Slurm's ``--signal=USR1@T`` (and ``scancel --signal=USR1``) reach every process of the
job step. torchrun would die of SIGUSR1 (it handles only TERM/INT/HUP/QUIT), taking its workers
down mid-save, so it is started with SIGUSR1 ignored; the workers (the trainer installs its own
handler) save a checkpoint and exit 0, and torchrun then exits 0. The launcher itself forwards
SIGUSR1 and SIGTERM to the workers, so ``kill -USR1 <launcher pid>`` works outside Slurm too,
and repeats SIGUSR1 until they exit (one that arrives while the trainer is still setting up is
not lost). SIGTERM (scancel, preemption, ``scontrol requeue``) is torchrun's own business: it
passes it on and kills the workers after its shutdown timeout; Slurm's KillWait bounds the
save in that case, so prefer ``--signal=USR1@<lead time>``.

Environment knobs (all optional): ``CONFIG`` (a YAML file, or a name under launch/configs/),
``NPROC_PER_NODE``, ``NNODES``, ``NODE_RANK``, ``RDZV_BACKEND`` (c10d|static), ``RDZV_HOST``,
``RDZV_PORT`` (default 20000 + job id mod 10000, else 29500), ``RDZV_CHECK_TIMEOUT`` (s, 120),
``TORCHRUN`` (the torchrun executable), ``LAUNCH_VALIDATE=0`` (skip the trainer's config
check), ``DRY_RUN=1`` (print the command and exit), ``TORCHRUN_ARGS`` (extra torchrun flags).
Environment defaults it sets only when unset: see :func:`environment_defaults`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "launch" / "configs"
TRAINER_MODULE = "epas_megatron.train"

CPU_PROCESSES_PER_NODE = 1
"""Processes per node without GPUs. On CPU, extra processes only add communication (TP/PP/DP
give no speed-up on a few cores); set NPROC_PER_NODE=2 or more to exercise parallelism."""

DEFAULT_RDZV_PORT = 29500
RDZV_PORT_BASE = 20000
"""With a Slurm job id the port is RDZV_PORT_BASE + job id mod 10000: below Linux's ephemeral
range, and different for jobs that share their first node."""


class LaunchError(Exception):
    """Bad input found before launching; printed as ``error: ...``, exit status 2."""

    exit_code = 2


@dataclass
class Rendezvous:
    """How the nodes find each other (multi-node only)."""

    backend: str
    """'c10d' (torchrun's elastic rendezvous) or 'static' (fixed node ranks)."""

    host: str
    """Rendezvous host: the first node of the allocation, or RDZV_HOST."""

    port: int
    """TCP port of the rendezvous store on the host."""

    run_id: str
    """c10d rendezvous id (the Slurm job id)."""


@dataclass
class LaunchSpec:
    """Everything the launcher decided; :func:`torchrun_command` turns it into argv."""

    nnodes: int
    """Nodes taking part."""

    nproc_per_node: int
    """Trainer processes per node."""

    node_rank: int
    """This node's index (0 hosts the rendezvous)."""

    gpus: int
    """GPUs visible on this node (0: CPU, gloo)."""

    rendezvous: Optional[Rendezvous]
    """None on a single node (torchrun --standalone)."""

    config: Optional[Path]
    """The run config file passed as --config (None: flags only)."""

    trainer_args: list[str]
    """Arguments after --config, passed through unchanged."""

    env_defaults: dict[str, str] = field(default_factory=dict)
    """Environment variables the launcher sets because they were unset."""

    torchrun: list[str] = field(default_factory=lambda: ["torchrun"])
    """The torchrun executable (argv prefix)."""

    extra_torchrun_args: list[str] = field(default_factory=list)
    """TORCHRUN_ARGS, split like a shell would."""

    node_name: str = ""
    """This node's name (for log prefixes)."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


# ---------------------------------------------------------------------------------- discovery
def _int_env(env: Mapping[str, str], name: str, minimum: int = 0) -> Optional[int]:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise LaunchError(f"{name}={value} must be >= {minimum}")
    return value


def count_gpus(env: Mapping[str, str]) -> int:
    """GPUs on this node: ``nvidia-smi -L`` lines, capped by CUDA_VISIBLE_DEVICES when set."""
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if out.returncode != 0:
        return 0
    gpus = sum(1 for line in out.stdout.splitlines() if line.strip().startswith("GPU "))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() not in ("-1", "NoDevFiles")]
        gpus = min(gpus, len(ids))
    return gpus


def cpus_available() -> int:
    """CPUs this process may run on (respects Slurm's and taskset's CPU masks)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def slurm_hostnames(nodelist: str, env: Mapping[str, str]) -> list[str]:
    """``scontrol show hostnames NODELIST`` (expands ``node[1-3,7]``)."""
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        raise LaunchError(f"SLURM_JOB_NODELIST={nodelist} is set but scontrol is not on PATH; "
                          "cannot find the rendezvous host (set RDZV_HOST)")
    out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60, env=dict(env))
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise LaunchError(f"scontrol show hostnames {nodelist} failed (exit {out.returncode}): {out.stderr.strip() or 'no hosts'}")
    return hosts


def resolve_config(value: Optional[str], cwd: Path) -> Optional[Path]:
    """CONFIG as a path (relative to the working directory or the repository) or a name."""
    if not value:
        return None
    candidates = [Path(value)] if Path(value).is_absolute() else [cwd / value, REPO_ROOT / value]
    if "/" not in value:
        candidates.append(CONFIG_DIR / (value if value.endswith((".yaml", ".yml")) else f"{value}.yaml"))
    for path in candidates:
        if path.is_file():
            return path.resolve()
    available = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))) or "none"
    raise LaunchError(f"CONFIG={value}: no such config file (looked in {', '.join(str(c) for c in dict.fromkeys(candidates))}); "
                      f"the configs under launch/configs/ are: {available}")


def environment_defaults(env: Mapping[str, str], gpus: int, nproc_per_node: int) -> dict[str, str]:
    """Variables the launcher sets when the user has not (export them to override).

    * ``OMP_NUM_THREADS``: the CPUs this launcher may use divided by the processes per node
      (torchrun would otherwise force 1).
    * ``PYTHONUNBUFFERED=1``: logs reach the Slurm output file as they are written.
    * GPU only: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron-Core's TP/SP communication overlap
      relies on kernel order), ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``, ``NCCL_DEBUG=WARN``,
      ``NCCL_IB_TIMEOUT=22`` (tolerate InfiniBand hiccups on large jobs). Site-specific NCCL
      settings (``NCCL_SOCKET_IFNAME``, ``NCCL_IB_HCA``) belong in the environment of the job.
    * CPU: nothing else; the trainer uses gloo when torch sees no GPU
      (``GLOO_SOCKET_IFNAME`` selects the interface on multi-homed hosts).
    """
    defaults = {
        "OMP_NUM_THREADS": str(max(1, cpus_available() // max(1, nproc_per_node))),
        "PYTHONUNBUFFERED": "1",
    }
    if gpus:
        defaults.update(
            CUDA_DEVICE_MAX_CONNECTIONS="1",
            TORCH_NCCL_AVOID_RECORD_STREAMS="1",
            NCCL_DEBUG="WARN",
            NCCL_IB_TIMEOUT="22",
        )
    return {k: v for k, v in defaults.items() if k not in env}


def _torchrun_prefix(env: Mapping[str, str]) -> list[str]:
    if env.get("TORCHRUN"):
        return shlex.split(env["TORCHRUN"])
    beside = Path(sys.executable).parent / "torchrun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    return [sys.executable, "-m", "torch.distributed.run"]


def make_launch_spec(argv: Sequence[str], env: Mapping[str, str], cwd: Optional[Path] = None) -> LaunchSpec:
    """Decide nodes, processes, rendezvous and environment from ``env`` (no side effects but
    running ``nvidia-smi`` and ``scontrol``)."""
    cwd = Path.cwd() if cwd is None else cwd
    config = resolve_config(env.get("CONFIG"), cwd)
    gpus = count_gpus(env)

    nproc = _int_env(env, "NPROC_PER_NODE", minimum=1)
    if nproc is None:
        nproc = gpus if gpus else CPU_PROCESSES_PER_NODE
    elif gpus and nproc > gpus:
        raise LaunchError(f"NPROC_PER_NODE={nproc} but this node has {gpus} GPU(s) visible; use at most {gpus} processes per node")

    job_id = env.get("SLURM_JOB_ID", "").strip()
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    if in_step:  # srun: the step's nodes (SLURM_NODELIST keeps the job's)
        slurm_nodes = _int_env(env, "SLURM_STEP_NUM_NODES", 1) or _int_env(env, "SLURM_NNODES", 1)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    else:
        slurm_nodes = _int_env(env, "SLURM_JOB_NUM_NODES", 1) or _int_env(env, "SLURM_NNODES", 1)
        nodelist = env.get("SLURM_JOB_NODELIST", "")
    in_slurm = bool(job_id and nodelist)
    nnodes = _int_env(env, "NNODES", minimum=1)
    node_name = env.get("SLURMD_NODENAME") or socket.gethostname()
    rendezvous = None
    node_rank = 0
    if nnodes is None:
        nnodes = (slurm_nodes or 1) if in_slurm else 1
    elif in_slurm and in_step and slurm_nodes and nnodes != slurm_nodes:
        raise LaunchError(f"NNODES={nnodes} but this Slurm job step runs on {slurm_nodes} node(s); unset NNODES")
    if nnodes > 1:
        if in_slurm:
            if not in_step:
                raise LaunchError(f"the Slurm allocation has {nnodes} nodes but this launcher does not run in a job step; "
                                  "start it with 'srun --ntasks-per-node=1 launch/run_train.sh ...' so that every node runs one launcher")
            tasks = _int_env(env, "SLURM_STEP_NUM_TASKS", 1) or _int_env(env, "SLURM_NTASKS", 1)
            if tasks is not None and tasks != nnodes:
                raise LaunchError(f"the job step runs {tasks} tasks on {nnodes} nodes; the launcher needs exactly one task per node "
                                  "(srun --ntasks-per-node=1), torchrun starts the processes")
            node_rank = _int_env(env, "SLURM_NODEID", 0) or 0
            host = env.get("RDZV_HOST") or slurm_hostnames(nodelist, env)[0]
        else:
            node_rank_env = _int_env(env, "NODE_RANK", 0)
            if node_rank_env is None or not env.get("RDZV_HOST"):
                raise LaunchError(f"NNODES={nnodes} outside a Slurm job step needs NODE_RANK (0..{nnodes - 1}) "
                                  "and RDZV_HOST (the node-rank-0 host) on every node")
            node_rank, host = node_rank_env, env["RDZV_HOST"]
        if node_rank >= nnodes:
            raise LaunchError(f"node rank {node_rank} is out of range for {nnodes} nodes")
        backend = env.get("RDZV_BACKEND", "c10d")
        if backend not in ("c10d", "static"):
            raise LaunchError(f"RDZV_BACKEND={backend!r}: choose c10d or static")
        port = _int_env(env, "RDZV_PORT", 1)
        if port is None:
            port = RDZV_PORT_BASE + int(job_id) % 10000 if job_id.isdigit() else DEFAULT_RDZV_PORT
        if port > 65535:
            raise LaunchError(f"RDZV_PORT={port} is not a TCP port")
        rendezvous = Rendezvous(backend=backend, host=host, port=port, run_id=job_id or "epas")

    return LaunchSpec(
        nnodes=nnodes,
        nproc_per_node=nproc,
        node_rank=node_rank,
        gpus=gpus,
        rendezvous=rendezvous,
        config=config,
        trainer_args=list(argv),
        env_defaults=environment_defaults(env, gpus, nproc),
        torchrun=_torchrun_prefix(env),
        extra_torchrun_args=shlex.split(env.get("TORCHRUN_ARGS", "")),
        node_name=node_name,
    )


def torchrun_command(spec: LaunchSpec) -> list[str]:
    """The exact argv that runs the trainer."""
    cmd = list(spec.torchrun)
    if spec.rendezvous is None:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        r = spec.rendezvous
        cmd += ["--nnodes", str(spec.nnodes)]
        if r.backend == "c10d":
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{r.host}:{r.port}", "--rdzv-id", r.run_id]
        else:
            cmd += ["--node-rank", str(spec.node_rank), "--master-addr", r.host, "--master-port", str(r.port)]
    cmd += ["--nproc-per-node", str(spec.nproc_per_node), "--max-restarts", "0"]
    cmd += spec.extra_torchrun_args
    cmd += ["-m", TRAINER_MODULE]
    if spec.config is not None:
        cmd += ["--config", str(spec.config)]
    cmd += spec.trainer_args
    return cmd


# ---------------------------------------------------------------------------------- checks
def will_it_fit(spec: LaunchSpec) -> list[str]:
    """``epas-plan``'s report for this launch (FLOPs, layouts per switch, memory per GPU), for
    ``DRY_RUN=1``; the GPU's memory is read where GPUs are."""
    from epas_megatron.config.cli import parse_config
    from epas_megatron.errors import ConfigError
    from epas_megatron.plan import report
    from epas_megatron.validation import resolve_run

    gpu_gb = None
    if spec.gpus:
        import torch

        gpu_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    try:
        run = resolve_run(parse_config(trainer_args(spec)), world_size=spec.world_size, cuda=bool(spec.gpus))
        lines, _ = report(run, gpu_gb)
    except ConfigError as e:
        raise LaunchError(f"the trainer rejects the run config: {e}") from None
    return lines


def trainer_args(spec: LaunchSpec) -> list[str]:
    """The arguments the trainer will parse (config first, then the pass-through flags)."""
    return (["--config", str(spec.config)] if spec.config is not None else []) + spec.trainer_args


def check_parallel_fit(spec: LaunchSpec, *, full: bool = True) -> None:
    """Parse the run config like the trainer does and check it against the world size.

    The TP x PP check is done here with the launcher's own wording (it names nodes and
    processes per node); ``full`` then runs the trainer's complete validation
    (``resolve_run``: heads vs TP, layers vs PP, batch sizes, EPAS schedule, output dir, ...),
    which imports Megatron-Core (a few seconds).
    """
    from epas_megatron.config.cli import parse_config
    from epas_megatron.errors import ConfigError

    try:
        cfg = parse_config(trainer_args(spec))
    except ConfigError as e:
        raise LaunchError(f"the trainer rejects the run config: {e}") from None
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    where = f"{spec.nnodes} node(s) x {spec.nproc_per_node} process(es) per node = {spec.world_size} processes"
    if tp < 1 or pp < 1 or spec.world_size % (tp * pp):
        preset = f"preset {cfg.model.preset} with " if cfg.model.preset else ""
        raise LaunchError(
            f"{preset}--tp {tp} x --pp {pp} = {tp * pp} does not divide the world of {where}; "
            f"change NPROC_PER_NODE / the node count, or --tp/--pp"
        )
    if not full:
        return
    from epas_megatron.validation import resolve_run

    try:
        resolve_run(cfg, world_size=spec.world_size, cuda=True if spec.gpus else None)
    except ConfigError as e:
        raise LaunchError(f"the run config does not fit {where}: {e}") from None


def _local_addresses_can_bind(addresses: list[str]) -> bool:
    for addr in addresses:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))
            return True
        except OSError:
            continue
    return False


def check_rendezvous(spec: LaunchSpec, env: Mapping[str, str]) -> None:
    """Multi-node: the host must resolve; node rank 0 must be that host; the other nodes
    must reach HOST:PORT within RDZV_CHECK_TIMEOUT seconds (node 0's torchrun opens it)."""
    r = spec.rendezvous
    if r is None:
        return
    try:
        infos = socket.getaddrinfo(r.host, r.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise LaunchError(f"rendezvous host {r.host!r} does not resolve ({e.strerror}); "
                          "check the node name, /etc/hosts/DNS, or set RDZV_HOST") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if spec.node_rank == 0:
        if not _local_addresses_can_bind(addresses):
            raise LaunchError(f"this is node rank 0 ({spec.node_name}) but the rendezvous host {r.host} ({', '.join(addresses)}) "
                              "is not an address of this machine; torchrun would wait for a store nobody hosts "
                              "(set RDZV_HOST to this node)")
        return
    timeout = float(env.get("RDZV_CHECK_TIMEOUT", "120"))
    deadline = time.monotonic() + timeout
    last_error = "no attempt"
    while True:
        try:
            with socket.create_connection((r.host, r.port), timeout=min(5.0, max(0.5, timeout))):
                return
        except OSError as e:
            last_error = e.strerror or str(e) or type(e).__name__
            if isinstance(e, socket.timeout):
                last_error = "connection timed out"
        if time.monotonic() >= deadline:
            raise LaunchError(
                f"rendezvous host {r.host}:{r.port} is not reachable from {spec.node_name} (node rank {spec.node_rank}) "
                f"after {timeout:g}s ({last_error}); is node rank 0 running, and is the port open between nodes? "
                f"(RDZV_PORT, RDZV_HOST, RDZV_CHECK_TIMEOUT)"
            )
        time.sleep(0.5)


# ---------------------------------------------------------------------------------- running
class SignalForwarder:
    """Forward SIGUSR1/SIGTERM from the launcher to torchrun's workers (its direct children).

    The workers inherit SIGUSR1 ignored (from torchrun) until the trainer installs its handler
    at the end of its setup, so a SIGUSR1 that arrives during setup would be lost: the
    launcher repeats it every :attr:`REPEAT_S` seconds until torchrun exits (the trainer's
    handler only sets a flag, so repeats are harmless).
    """

    FORWARDED = (signal.SIGUSR1, signal.SIGTERM)
    REPEAT_S = 5.0

    def __init__(self):
        self.process: Optional[subprocess.Popen] = None
        self.received: list[int] = []

    def install(self) -> None:
        for sig in self.FORWARDED:
            signal.signal(sig, self._handle)
        # Ctrl-C reaches torchrun directly (same foreground process group); the launcher waits.
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)
        self.forward(signum)

    def forward(self, signum: int) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for pid in worker_pids(self.process.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        """Wait for torchrun, repeating a received SIGUSR1 to its workers until it exits."""
        while True:
            try:
                return self.process.wait(timeout=self.REPEAT_S)
            except subprocess.TimeoutExpired:
                if signal.SIGUSR1 in self.received:
                    self.forward(signal.SIGUSR1)


def worker_pids(parent_pid: int) -> list[int]:
    """Direct children of ``parent_pid`` (torchrun's workers), from /proc or psutil."""
    try:
        import psutil

        return [child.pid for child in psutil.Process(parent_pid).children(recursive=False)]
    except ImportError:
        pass
    except Exception:  # psutil.NoSuchProcess and friends
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == parent_pid:
                    pids.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return pids


def _ignore_usr1() -> None:  # runs in the torchrun child before exec
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def main(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if env is None else env)
    forwarder = SignalForwarder()
    forwarder.install()
    try:
        spec = make_launch_spec(argv, env)
        prefix = f"[launch {spec.node_name}]" if spec.nnodes > 1 else "[launch]"

        def log(message: str) -> None:
            print(f"{prefix} {message}", flush=True)

        if env.get("LAUNCH_VALIDATE", "1") != "0":
            check_parallel_fit(spec, full=True)
        else:
            check_parallel_fit(spec, full=False)
        command = torchrun_command(spec)
        where = "single node" if spec.rendezvous is None else (
            f"node {spec.node_rank} of {spec.nnodes}, {spec.rendezvous.backend} rendezvous at {spec.rendezvous.host}:{spec.rendezvous.port}"
        )
        log(f"{where}; {spec.nproc_per_node} process(es) per node; {spec.gpus} GPU(s) -> {'nccl' if spec.gpus else 'gloo'}")
        if spec.env_defaults:
            log("environment defaults (export to override): " + " ".join(f"{k}={v}" for k, v in spec.env_defaults.items()))
        log("command: " + shlex.join(command))
        if env.get("DRY_RUN", "0") not in ("", "0"):
            if env.get("LAUNCH_VALIDATE", "1") != "0":
                for line in will_it_fit(spec):
                    log(line)
            return 0
        check_rendezvous(spec, env)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return LaunchError.exit_code

    child_env = {**env, **spec.env_defaults}
    process = subprocess.Popen(command, env=child_env, preexec_fn=_ignore_usr1)
    forwarder.process = process
    code = forwarder.wait()
    if forwarder.received:
        names = ", ".join(signal.Signals(s).name for s in dict.fromkeys(forwarder.received))
        log(f"forwarded {names} to the trainer processes; torchrun exited with {code}")
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
