"""Helpers shared by the tests: run the trainer (one process or torchrun) and read its outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]

COMMANDS_BY_SCRIPT = {  # the console scripts of pyproject.toml -> the modules they (and torchrun / python -m) start
    "epas-train": "epas_megatron.train", "epas-plan": "epas_megatron.plan", "epas-eval": "epas_megatron.evaluate",
    "epas-bench": "epas_megatron.bench.cli", "epas-preprocess": "epas_megatron.data.preprocess",
    "epas-convert": "epas_megatron.convert.cli", "epas-generate": "epas_megatron.generate",
}

TINY = ["--preset", "tiny", "--eval-interval", "0", "--no-tensorboard", "--log-interval", "1"]


@dataclass
class TrainerRun:
    """A finished trainer process."""

    returncode: int
    stdout: str
    stderr: str
    output_dir: Path
    summary: Optional[dict] = None
    metrics: list = field(default_factory=list)

    @property
    def train_records(self) -> list[dict]:
        return [m for m in self.metrics if "kind" not in m]

    @property
    def losses(self) -> dict[int, float]:
        return {m["iteration"]: m["lm_loss"] for m in self.train_records}

    @property
    def grad_norms(self) -> dict[int, float]:
        return {m["iteration"]: m["grad_norm"] for m in self.train_records}

    @property
    def switches(self) -> list[dict]:
        return [m for m in self.metrics if m.get("kind") == "switch"]


def trainer_command(args: Sequence[str], nproc: int = 1, module: str = "epas_megatron.train",
                    command: Optional[Sequence[str]] = None) -> list[str]:
    """python -m <module> ... for one process, torchrun --standalone for several; ``command``
    (e.g. an installed entry point) instead of ``python -m <module>`` for one process."""
    if command is not None:
        return [*command, *args]
    if nproc == 1:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", module, *args]


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def parse_summary(stdout: str) -> Optional[dict]:
    lines = [l for l in stdout.splitlines() if l.startswith("SUMMARY ")]
    return json.loads(lines[-1][len("SUMMARY "):]) if lines else None


IN_PROCESS = os.environ.get("EPAS_TEST_TRAINER_PROCESSES") != "1"
"""One-process trainer runs go through ``epas_megatron.train.main`` in the test process (the same
code as the command, without an interpreter start and a re-import of torch and Megatron-Core);
``EPAS_TEST_TRAINER_PROCESSES=1`` starts a process for every run instead."""


RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What ``init_distributed`` puts into this process's environment while a world of one is alive
in it (an in-process run or fixture): a child must not inherit them (it would join, or try to
bind, this process's rendezvous port)."""


P2P_RULES = "nccl"
"""``EPAS_P2P_RULES`` of every child process unless this process's environment sets it (an empty
value runs plain gloo): every multi-process run the tests start moves its tensors under NCCL's
point-to-point rules (epas_megatron/compat/nccl_rules.py) -- a send completes only once its
receive runs, in order per channel, tags ignored -- so what passes here would not hang a cluster.
On a GPU node the process group is NCCL itself and the transport stays out."""


def child_environ() -> dict:
    """This process's environment for a child process, without :data:`RENDEZVOUS_VARIABLES`, with
    :data:`P2P_RULES` unless set."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARIABLES}
    env.setdefault("EPAS_P2P_RULES", P2P_RULES)
    return env


FORKED = os.environ.get("EPAS_TEST_TORCHRUN") != "1"
"""Multi-rank trainer runs and test scripts fork their ranks from one server process that
imported torch, Megatron-Core and epas-megatron once (tests/fork_server.py), instead of
starting torchrun and an interpreter per rank; ``EPAS_TEST_TORCHRUN=1`` uses torchrun. Tests
of the launch itself (launcher, Slurm, README, the pipeline bench) always start real torchrun."""


class ForkServer:
    """The client side of tests/fork_server.py (one server per test session, started on first
    use and restarted after a run it had to kill)."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None

    def _start(self) -> None:
        env = {**child_environ(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fork_server.py"))], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        ready = self.proc.stdout.readline()
        if not ready.startswith('{"ready"'):
            self.close()
            raise RuntimeError(f"the fork server did not start: {ready!r}")

    def run(self, target: dict, argv: Sequence[str], nproc: int, env: dict, timeout: float) -> tuple[int, str, str]:
        """(exit status as torchrun's, stdout, stderr) of ``nproc`` ranks running ``target``."""
        import tempfile

        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory(prefix="epas-fork-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {**target, "argv": list(argv), "nproc": nproc, "env": env, "cwd": str(REPO),
                       "stdout": str(out), "stderr": str(err), "timeout": timeout}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
            stdout = out.read_text() if out.exists() else ""
            stderr = err.read_text() if err.exists() else ""
        if not answer:
            self.close()
            raise RuntimeError(f"the fork server died during a run\n--- stderr\n{stderr[-4000:]}")
        result = json.loads(answer)
        if result["timed_out"]:
            raise subprocess.TimeoutExpired(["fork-server", *argv], timeout, stdout, stderr)
        return result["returncode"], stdout, stderr

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


_FORK_SERVER: Optional[ForkServer] = None


def fork_server() -> ForkServer:
    """The session's fork server (closed when the interpreter exits)."""
    global _FORK_SERVER
    if _FORK_SERVER is None:
        import atexit

        _FORK_SERVER = ForkServer()
        atexit.register(_FORK_SERVER.close)
    return _FORK_SERVER


def run_trainer(
    args: Sequence[str],
    output_dir: Path,
    nproc: int = 1,
    env: Optional[dict] = None,
    timeout: int = 900,
    check: bool = True,
    module: str = "epas_megatron.train",
    command: Optional[Sequence[str]] = None,
    in_process: Optional[bool] = None,
) -> TrainerRun:
    """Run the trainer to completion and collect stdout, SUMMARY and metrics.jsonl.

    One process with no extra environment runs in this process (:func:`_main_in_process`) unless
    ``in_process=False`` or this process already holds a process group (a test's ``world``
    fixture: the run would find Megatron's groups initialised, and tear them down); several ranks
    fork from the session's fork server (:data:`FORKED`); an installed ``command``, another
    ``module`` or ``env`` with one process start a process."""
    argv = [*args, "--output-dir", str(output_dir)]
    if in_process is None:
        in_process = (IN_PROCESS and nproc == 1 and command is None and module == "epas_megatron.train" and not env
                      and not holds_a_process_group())
    if in_process:
        returncode, stdout, stderr = _main_in_process(argv)
        cmd = ["epas_megatron.train.main", *argv]
    elif FORKED and nproc > 1 and command is None:
        full_env = {**child_environ(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        cmd = ["fork-server", f"--nproc-per-node={nproc}", "-m", module, *argv]
        returncode, stdout, stderr = fork_server().run({"module": module}, argv, nproc, full_env, timeout)
    else:
        full_env = {**child_environ(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        cmd = trainer_command(argv, nproc, module, command)
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    run = TrainerRun(
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        output_dir=Path(output_dir),
        summary=parse_summary(stdout),
        metrics=read_metrics(output_dir),
    )
    if check and returncode != 0:
        raise AssertionError(f"trainer failed ({returncode}): {' '.join(cmd)}\n--- stdout\n{stdout[-4000:]}"
                             f"\n--- stderr\n{stderr[-6000:]}")
    return run


def holds_a_process_group() -> bool:
    """This process has a torch.distributed world of its own (a test's fixture made it)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _main_in_process(argv: Sequence[str], module: str = "epas_megatron.train") -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python -m module argv`` (``epas-train`` by default) run
    by the module's ``main`` in this process, as a process of its own would run it: one intra-op
    thread (the subprocesses' OMP_NUM_THREADS=1),
    and the process-wide settings a run may change (threads, deterministic algorithms, the
    environment) restored, the process group torn down even after a crash."""
    import contextlib
    import importlib
    import io
    import traceback

    import torch
    import torch.distributed as dist

    main = importlib.import_module(module).main

    stdout, stderr = io.StringIO(), io.StringIO()
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    environ = dict(os.environ)
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                returncode = main(list(argv))
            except SystemExit as exit_:  # argparse's usage errors
                returncode = exit_.code if isinstance(exit_.code, int) else 1
            except Exception:  # what the interpreter would print before exiting with 1
                traceback.print_exc()
                returncode = 1
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        os.environ.clear()
        os.environ.update(environ)
        if dist.is_initialized():
            from epas_megatron.runtime.distributed import destroy_distributed

            destroy_distributed()
    return returncode, stdout.getvalue(), stderr.getvalue()


def run_script(script: Path, args: Sequence[str] = (), nproc: int = 2, timeout: int = 900,
               env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run a test script with ``nproc`` ranks (forked from the fork server, :data:`FORKED`, else
    torchrun); raise with its output if it fails."""
    full_env = {**child_environ(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if FORKED:
        cmd = ["fork-server", f"--nproc-per-node={nproc}", str(script), *args]
        code, stdout, stderr = fork_server().run({"script": str(script)}, list(args), nproc, full_env, timeout)
        proc = subprocess.CompletedProcess(cmd, code, stdout, stderr)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script), *args]
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"script failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def json_lines(stdout: str, tag: str) -> list[dict]:
    """Objects printed as '<tag> {json}' lines.

    Ranks share one stdout pipe and, unbuffered, ``print`` writes the text and its newline in
    two calls, so another rank's line can land between them (``<tag> {a}<tag> {b}``): every
    object that follows the tag at a line start or right after another object is read."""
    decoder, prefix, found = json.JSONDecoder(), tag + " ", []
    for line in stdout.splitlines():
        pos = 0
        while line.startswith(prefix, pos):
            obj, pos = decoder.raw_decode(line, pos + len(prefix))
            found.append(obj)
    return found


def model_shape(num_layers: int, hidden_size: int, num_attention_heads: int, num_query_groups: int, ffn_hidden_size: int,
                vocab_size: int, seq_length: int, micro_batch_size: int = 1, max_sequence_length: Optional[int] = None):
    """The FLOP and memory models' :class:`~epas_megatron.model.architecture.ModelShape` of an
    architecture given by the numbers a test cares about (the others at their defaults), with room
    for ``max_sequence_length`` tokens (default ``seq_length``)."""
    from epas_megatron.model.architecture import LlamaArchitecture, ModelShape

    arch = LlamaArchitecture(num_layers, hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size, vocab_size,
                             seq_length if max_sequence_length is None else max_sequence_length)
    return ModelShape(arch, seq_length, micro_batch_size)


def assert_close(a: dict, b: dict, rel: float = 1e-5, what: str = "") -> None:
    assert a.keys() == b.keys(), f"{what}: iterations differ {sorted(a)} vs {sorted(b)}"
    for k in a:
        assert abs(a[k] - b[k]) <= rel * max(abs(a[k]), abs(b[k]), 1e-12), f"{what} at {k}: {a[k]!r} vs {b[k]!r}"


def build(arch, sharing=(), share="qk", seed=11, detach=False, core_attention="sdpa", precision="fp32", exclude_last=0, blocks=1,
          options=()):
    """One in-process model chunk (needs an initialised world of one); ``sharing`` must be a region
    of ``blocks`` blocks, the deepest ending ``exclude_last`` layers before the last; ``options``:
    build options (:mod:`epas_megatron.build_option`)."""
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model
    from epas_megatron.sharing.shape import RegionShape

    plan = BuildPlan.for_region(arch, sharing, precision=precision, share=share, detach_shared=detach,
                                core_attention=core_attention, shape=RegionShape(arch.num_layers, exclude_last, blocks),
                                options=tuple(options))
    return build_model(plan, seed=seed).chunks[0]


def main_weight_mismatches(optimizer) -> list[str]:
    """Where the optimizer's fp32 main weights differ from the model's half-precision weights
    (empty: every main weight equals its model weight, upcast). Read straight from Megatron's
    own fields: the mixed-precision optimizer's ``float16_groups`` / ``fp32_from_float16_groups``
    and the distributed optimizer's ``model_float16_groups`` / ``shard_fp32_from_float16_groups``
    with each parameter's element range; an fp32 optimizer steps the model's weights themselves."""
    import torch

    mismatches = []
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if hasattr(part, "shard_fp32_from_float16_groups"):  # distributed optimizer
            pairs = [(p, m, part._get_model_param_range_map(p)["param"])
                     for model_group, main_group in zip(part.model_float16_groups, part.shard_fp32_from_float16_groups)
                     for p, m in zip(model_group, main_group)]
        elif hasattr(part, "fp32_from_float16_groups"):  # mixed-precision optimizer
            pairs = [(p, m, None) for model_group, main_group in zip(part.float16_groups, part.fp32_from_float16_groups)
                     for p, m in zip(model_group, main_group)]
        else:
            continue
        for param, main, elements in pairs:
            model = param.detach().float().view(-1)
            if elements is not None:
                model = model[elements.start:elements.end]
            if not torch.equal(main.detach().view(-1), model):
                mismatches.append(f"{tuple(param.shape)}: max |main - model| = {(main.detach().view(-1) - model).abs().max().item()}")
    return mismatches


def train_in_process(args: Sequence[str], output_dir: Path, *, after_load=None, world_size: Optional[int] = None) -> TrainerRun:
    """Run the trainer in this process (no interpreter start, no re-import of Megatron-Core),
    collecting what :func:`run_trainer` collects. ``after_load(trainer, what)`` is called right
    after every load into built objects: ``what`` is 'setup' (after a resume or --pretrained)
    and 'switch' (after each EPAS switch). Under torchrun, every rank calls it with its own
    ``world_size`` (default: torchrun's, else 1)."""
    import contextlib
    import io

    from epas_megatron.config.cli import parse_config
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    run = resolve_run(parse_config([*args, "--output-dir", str(output_dir)]), world_size=world_size)
    trainer = Trainer(run)
    stdout, returncode = io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(stdout):
            trainer.setup()
            if after_load is not None:
                if run.load_dir is not None or run.pretrained_dir is not None:
                    after_load(trainer, "setup")
                apply_switch = trainer.apply_switch

                def checked_switch(sharing_layers):
                    info = apply_switch(sharing_layers)
                    after_load(trainer, "switch")
                    return info

                trainer.apply_switch = checked_switch
            trainer.train()
    except BaseException as error:
        returncode = getattr(error, "exit_code", 1)
        if not hasattr(error, "exit_code"):
            raise
        stdout.write(f"error: {error}\n")
    finally:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # Under torchrun the process group stays for the next run: a second
            # init_process_group on torchrun's store would wait for a rendezvous that never comes.
            from unittest import mock

            from megatron.core import parallel_state

            with mock.patch("epas_megatron.training.trainer.destroy_distributed", parallel_state.destroy_model_parallel):
                trainer.close()
        else:
            trainer.close()
    text = stdout.getvalue()
    return TrainerRun(returncode=returncode, stdout=text, stderr="", output_dir=Path(output_dir),
                      summary=parse_summary(text), metrics=read_metrics(output_dir))


def hf_offline():
    """A context in which Hugging Face datasets and the hub never reach the network (lm_eval and
    transformers would otherwise try to); the tests build everything they load."""
    import pytest

    patch = pytest.MonkeyPatch.context()
    with patch as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_HUB_OFFLINE", "1")
        yield


def reference_weights(model, arch, requires_grad: bool = False):
    """(Hugging Face-named weights, tests/llama_reference.py's weights) of a model chunk, through
    the HF mapping (which tests/convert checks against transformers' own LlamaForCausalLM);
    ``requires_grad``: fresh leaves, for comparing gradients."""
    import llama_reference as ref
    from epas_megatron.convert.hf_llama import megatron_to_hf, strip_extra_state

    hf = megatron_to_hf(strip_extra_state(model.state_dict()), arch)
    if requires_grad:
        hf = {k: v.clone().requires_grad_(True) for k, v in hf.items()}
    return hf, ref.weights_from_hf_style(hf, arch.num_layers)


def per_token_loss(logits, labels):
    """Cross entropy per token, [b, s] (the model's loss with ``labels``)."""
    import torch

    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def assert_same_gradient(got, expected, tol: float = 1e-5):
    """fp32 gradients summed in different orders: compare relative to the whole tensor's norm."""
    error = (got - expected).norm() / expected.norm()
    assert error < tol, f"relative gradient error {error:.2e}"
