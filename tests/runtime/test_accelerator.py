"""No silent CPU fallback (runtime/accelerator.py): the decision, branch by branch, on facts; the
probes on a fake /proc, /dev and nvidia-smi; the supported torch range where the packaging
states it; and one process on this CPU machine that a fake nvidia-smi makes look like a GPU node
whose torch cannot use its GPUs."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from epas_megatron.errors import ConfigError
from epas_megatron.runtime import accelerator
from epas_megatron.runtime.accelerator import (
    SUPPORTED_TORCH,
    SUPPORTED_TORCH_RANGE,
    AcceleratorFacts,
    accelerator_problem,
    gpus_hidden,
    node_gpu_facts,
    torch_version_problem,
)
from epas_testing import REPO

SMI = ("nvidia-smi lists 1 GPU (NVIDIA H100 80GB HBM3)",)


def facts(**kwargs):
    base = dict(torch_version="2.14.1+cu130", torch_cuda="13.0", cuda_available=False)
    return AcceleratorFacts(**{**base, **kwargs})


# ----------------------------------------------------------------------- the supported range
@pytest.mark.parametrize("version", ["2.6.0", "2.6.0a0+ecf3bae40a", "2.11.0+cu130", "2.14.1", "2.14.1+cu130", "2.14.99"])
def test_versions_inside_the_range(version):
    assert torch_version_problem(version) is None


@pytest.mark.parametrize("version", ["2.5.1", "2.5.1+cu124", "1.13.1", "2.15.0", "2.15.0.dev20261101+cu130", "3.0.0", "", "unknown"])
def test_versions_outside_the_range_name_the_version_and_the_range(version):
    problem = torch_version_problem(version)
    assert problem is not None and f"torch {version} is outside" in problem and SUPPORTED_TORCH in problem


def test_the_packaging_states_the_same_range():
    """pyproject.toml's dependency is the range (a node's working torch is never replaced by a
    pin); requirements.txt (CPU machines, CI) pins one version inside it."""
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in dependencies if re.match(r"torch\b", d)] == [f"torch{SUPPORTED_TORCH}"]
    low, high = SUPPORTED_TORCH_RANGE
    assert SUPPORTED_TORCH == f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    (pin,) = re.findall(r"^torch==(\S+)", (REPO / "requirements.txt").read_text(), re.M)
    assert torch_version_problem(pin) is None
    # megatron-core's own lower bound (its wheel metadata) is the range's.
    from importlib.metadata import requires

    (megatron_torch,) = [r for r in requires("megatron-core") if re.match(r"torch\b", r) and "extra" not in r]
    assert megatron_torch.replace(" ", "") == "torch>=2.6.0"


# ----------------------------------------------------------------------- the decision
def test_out_of_range_torch_is_an_error_even_where_cuda_works_or_there_is_no_gpu():
    for case in (facts(torch_version="2.5.1+cu124", cuda_available=True), facts(torch_version="2.16.0", torch_cuda=None),
                 facts(torch_version="2.4.0", cuda_visible_devices="")):
        assert "outside the supported range" in accelerator_problem(case)


def test_cuda_usable_is_fine():
    assert accelerator_problem(facts(cuda_available=True, gpu_evidence=SMI, driver_version="580.65.06")) is None


def test_a_machine_without_gpus_is_fine():
    assert accelerator_problem(facts(torch_cuda=None, torch_version="2.14.1+cpu")) is None
    assert accelerator_problem(facts()) is None  # a CUDA build on a CPU machine (this one)


@pytest.mark.parametrize("value", ["", " ", "-1", "-1,0", " -1 , 1", "NoDevFiles"])
def test_gpus_hidden_on_purpose_are_fine(value):
    assert gpus_hidden(value)
    assert accelerator_problem(facts(torch_cuda=None, gpu_evidence=SMI, cuda_visible_devices=value)) is None


@pytest.mark.parametrize("value", [None, "0", "0,1", "GPU-5f3c", "1,-1"])
def test_devices_named_are_not_hidden(value):
    assert not gpus_hidden(value)


def test_cuda_visible_devices_naming_gpus_is_evidence_by_itself():
    problem = accelerator_problem(facts(cuda_visible_devices="0,1"))
    assert problem is not None and "CUDA_VISIBLE_DEVICES=0,1 names GPUs" in problem


def test_cpu_only_build_on_a_gpu_node():
    problem = accelerator_problem(facts(torch_version="2.14.1+cpu", torch_cuda=None, gpu_evidence=SMI, driver_version="580.65.06"))
    assert "torch 2.14.1+cpu (CPU-only build) cannot use a GPU" in problem
    assert "nvidia-smi lists 1 GPU (NVIDIA H100 80GB HBM3)" in problem
    assert "this node has NVIDIA driver 580.65.06" in problem
    assert "silently fall back to the CPU" in problem
    assert "install a torch built for this driver" in problem and "use the node's own torch" in problem
    assert "CUDA_VISIBLE_DEVICES= (empty)" in problem


def test_cuda_build_newer_than_the_driver():
    problem = accelerator_problem(facts(gpu_evidence=SMI, driver_version="570.86.15"))
    assert "torch 2.14.1+cu130 (CUDA 13.0 build) is built for CUDA 13.0, which needs NVIDIA driver >= 580.65.06" in problem
    assert "this node has NVIDIA driver 570.86.15" in problem and "CUDA_VISIBLE_DEVICES= (empty)" in problem


@pytest.mark.parametrize("cuda, driver", [("12.8", "535.104.05"), ("11.8", "450.80.02"), ("13.0", "580.65.06")])
def test_minor_version_compatibility_is_not_mistaken_for_an_old_driver(cuda, driver):
    problem = accelerator_problem(facts(torch_cuda=cuda, gpu_evidence=SMI, driver_version=driver))
    assert "could not initialise CUDA" in problem and "needs NVIDIA driver" not in problem


def test_other_cuda_failures_pass_on_what_torch_said():
    problem = accelerator_problem(facts(gpu_evidence=("/dev/nvidia0 exists",), driver_version="580.95.05",
                                        torch_warning="CUDA initialization: Unexpected error from cudaGetDeviceCount()"))
    assert "could not initialise CUDA" in problem and "/dev/nvidia0 exists" in problem
    assert "(torch said: CUDA initialization: Unexpected error from cudaGetDeviceCount())" in problem


def test_unknown_driver_is_said_so():
    problem = accelerator_problem(facts(gpu_evidence=("/proc/driver/nvidia/gpus has 2 entries",)))
    assert "the NVIDIA driver version is unknown" in problem and "could not initialise CUDA" in problem


# ----------------------------------------------------------------------- the probes
def fake_smi(bin_dir: Path, body: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)
    return bin_dir


def test_proc_and_dev_entries_are_evidence(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi
    assert node_gpu_facts(tmp_path) == ((), None)
    (tmp_path / "proc/driver/nvidia/gpus/0000:3b:00.0").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/gpus/0000:5e:00.0").mkdir()
    (tmp_path / "proc/driver/nvidia/version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n"
        "GCC version:  gcc version 12.2.0\n")
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidiactl").touch()
    assert node_gpu_facts(tmp_path) == (("/proc/driver/nvidia/gpus has 2 entries",), "580.65.06")
    (tmp_path / "dev/nvidia0").touch()
    (tmp_path / "proc/driver/nvidia/version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 2024\n")
    assert node_gpu_facts(tmp_path) == (("/proc/driver/nvidia/gpus has 2 entries", "/dev/nvidia0 exists"), "550.54.14")


def test_nvidia_smi_lists_gpus_and_the_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_smi(tmp_path / "bin",
                                            'echo "NVIDIA H100 80GB HBM3, 580.65.06"; echo "NVIDIA H100 80GB HBM3, 580.65.06"')))
    assert node_gpu_facts(tmp_path) == (("nvidia-smi lists 2 GPUs (NVIDIA H100 80GB HBM3)",), "580.65.06")


@pytest.mark.parametrize("body", ['echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9',
                                  "sleep 30"], ids=["fails", "hangs"])
def test_a_broken_nvidia_smi_is_no_evidence(tmp_path, monkeypatch, body):
    monkeypatch.setenv("PATH", str(fake_smi(tmp_path / "bin", f"exec {body}" if body.startswith("sleep") else body)))
    assert node_gpu_facts(tmp_path, timeout=0.5) == ((), None)


def test_check_accelerator_raises_config_error(monkeypatch):
    monkeypatch.setattr(accelerator, "torch_facts", lambda: facts(torch_version="2.14.1+cpu", torch_cuda=None))
    monkeypatch.setattr(accelerator, "node_gpu_facts", lambda root=Path("/"), timeout=5.0: (SMI, "580.65.06"))
    with pytest.raises(ConfigError, match="CPU-only build") as error:
        accelerator.check_accelerator()
    assert error.value.exit_code == 2
    # the node is not probed where the answer cannot depend on it
    monkeypatch.setattr(accelerator, "node_gpu_facts", lambda root=Path("/"), timeout=5.0: pytest.fail("probed"))
    monkeypatch.setattr(accelerator, "torch_facts", lambda: facts(cuda_available=True))
    assert accelerator.check_accelerator().cuda_available


def test_this_machine_passes_the_check():
    """Here (CPU machine, or a GPU node whose torch works) the check is silent."""
    found = accelerator.check_accelerator()
    assert found.torch_version == torch.__version__ and found.cuda_available == torch.cuda.is_available()


# ----------------------------------------------------------------------- one process, a fake GPU node
CHECK = "from epas_megatron.runtime.accelerator import check_accelerator; check_accelerator(); print('STARTED')"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU that torch can use: the fake nvidia-smi cannot make it unusable")
def test_a_visible_gpu_torch_cannot_use_stops_the_process_before_any_work(tmp_path):
    bin_dir = fake_smi(tmp_path / "bin", 'echo "NVIDIA H100 80GB HBM3, 570.86.15"')
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "STARTED" not in proc.stdout
    (message,) = [line for line in proc.stderr.splitlines() if line.startswith("epas_megatron.errors.ConfigError: ")]
    assert f"torch {torch.__version__}" in message
    assert ("CPU-only build" in message) if torch.version.cuda is None else (f"CUDA {torch.version.cuda} build" in message)
    assert "nvidia-smi lists 1 GPU (NVIDIA H100 80GB HBM3)" in message and "NVIDIA driver 570.86.15" in message
    assert "install a torch built for this driver" in message and "CUDA_VISIBLE_DEVICES= (empty)" in message
    # the same node with the GPUs hidden on purpose runs
    hidden = subprocess.run([sys.executable, "-c", CHECK], env={**env, "CUDA_VISIBLE_DEVICES": ""}, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert hidden.returncode == 0 and hidden.stdout.strip() == "STARTED", hidden.stderr


# ----------------------------------------------------------------------- every GPU entry point asks first
ENTRY_POINTS = {
    "epas-train": ("epas_megatron.train", ["--preset", "tiny", "--output-dir", "{tmp}/run"]),
    "epas-eval": ("epas_megatron.evaluate", ["--load", "{tmp}/missing", "--regions", "0"]),
    "epas-generate": ("epas_megatron.generate", ["--load", "{tmp}/missing", "--prompt", "x"]),
    "epas-bench": ("epas_megatron.bench.cli", ["train", "--preset", "tiny"]),
}


@pytest.mark.parametrize("command", list(ENTRY_POINTS))
def test_entry_points_stop_before_any_work_on_a_gpu_node_torch_cannot_use(command, monkeypatch, capsys, tmp_path):
    """In process, with a node that shows a GPU and a torch that cannot use it: exit status 2,
    the error line, and nothing made (no output directory, not even a missing checkpoint noticed)."""
    import importlib

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(accelerator, "torch_facts", lambda: facts(torch_version="2.14.1+cpu", torch_cuda=None))
    monkeypatch.setattr(accelerator, "node_gpu_facts", lambda root=Path("/"), timeout=5.0: (SMI, "580.65.06"))
    module, argv = ENTRY_POINTS[command]
    status = importlib.import_module(module).main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert status == 2 and "error: " in err and "CPU-only build" in err and "580.65.06" in err, err
    assert "missing" not in err and not (tmp_path / "run").exists()
