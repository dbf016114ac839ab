"""No silent CPU fallback: stop before any work where this node's GPUs are visible but torch
cannot use them, and where torch is outside the range the project supports.

Everything here falls back to the CPU when ``torch.cuda.is_available()`` is False. On a machine
with no GPU that is the point; on a GPU node it is a trap: a CPU-only wheel, or a CUDA wheel built
for a newer CUDA than the driver supports (``pip install torch`` on a node whose driver is older
than the wheel's CUDA), runs the whole job on the CPU -- slowly, in fp32, and without a word. So
every entry point calls :func:`check_accelerator` first; it raises
:class:`~epas_megatron.errors.ConfigError` (printed as ``error: ...``, exit status 2) naming the
torch build, the driver and what to do.

The design: :func:`detect` gathers a few facts into :class:`AcceleratorFacts` (no CUDA
initialisation beyond ``torch.cuda.is_available()``; ``nvidia-smi`` with a short timeout, a
missing binary is fine); :func:`accelerator_problem` is a pure decision over those facts (tested
branch by branch without processes or GPUs); :func:`check_accelerator` is the two together.

What counts as "GPUs visible": ``nvidia-smi`` lists GPUs, ``/proc/driver/nvidia/gpus`` has
entries, ``/dev/nvidia<N>`` exists, or ``CUDA_VISIBLE_DEVICES`` names devices. An empty
``CUDA_VISIBLE_DEVICES`` (or ``-1``) means the GPUs are hidden on purpose -- the documented way to
run on the CPU of a GPU node -- and is never an error.

**The supported torch range** (:data:`SUPPORTED_TORCH`, also ``pyproject.toml``'s requirement):
the lower bound is megatron-core 0.19.2's own requirement (``torch>=2.6.0`` in its wheel
metadata); the upper bound excludes the first minor release nobody has run here. Run so far:
2.14.1 (the stack: ``requirements.txt`` pins it for CPU machines and CI) and 2.11.0+cu130 (the
torch a bare GPU node brought). A node's own torch anywhere in the range is used as it is: the
project never replaces a working CUDA torch with its pin. Versions are compared by release
(major, minor), so vendor builds such as NGC's ``2.6.0a0+ecf3bae40a`` count as their release.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from epas_megatron.errors import ConfigError

__all__ = [
    "SUPPORTED_TORCH", "SUPPORTED_TORCH_RANGE", "AcceleratorFacts", "accelerator_problem", "torch_version_problem",
    "gpus_hidden", "detect", "check_accelerator",
]

SUPPORTED_TORCH = ">=2.6,<2.15"
"""The torch versions this project supports, as a pip specifier (``pyproject.toml`` uses it)."""
SUPPORTED_TORCH_RANGE = ((2, 6), (2, 15))
""":data:`SUPPORTED_TORCH` as release tuples: lowest supported, first unsupported."""

# The oldest Linux driver each CUDA major version runs on (CUDA's minor-version compatibility:
# any 12.x build runs on a 12.0 driver, any 13.x build on a 13.0 driver).
MIN_DRIVER_FOR_CUDA = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

NVIDIA_SMI_TIMEOUT_S = 5.0

WHAT_TO_DO = (
    "install a torch built for this driver (a CUDA build whose CUDA the driver supports), or use the node's own "
    "torch (the one the node's python already has); or set CUDA_VISIBLE_DEVICES= (empty) to run on the CPU deliberately"
)


@dataclass(frozen=True)
class AcceleratorFacts:
    """What :func:`accelerator_problem` decides from (gathered by :func:`detect`)."""

    torch_version: str
    """``torch.__version__``, e.g. ``2.14.1+cu130``."""
    torch_cuda: Optional[str]
    """``torch.version.cuda``, e.g. ``13.0``; None for a CPU-only build."""
    cuda_available: bool
    """``torch.cuda.is_available()``."""
    cuda_visible_devices: Optional[str] = None
    """``CUDA_VISIBLE_DEVICES``; None when unset."""
    gpu_evidence: tuple[str, ...] = ()
    """What shows this node has NVIDIA GPUs, one phrase each (``nvidia-smi lists 1 GPU (NVIDIA
    H100 80GB HBM3)``, ``/dev/nvidia0 exists``); empty on a machine without any."""
    driver_version: Optional[str] = None
    """The NVIDIA driver, e.g. ``580.65.06``; None where none was found."""
    torch_warning: str = ""
    """What ``torch.cuda.is_available()`` warned, if anything (torch says why CUDA failed)."""

    @property
    def torch_build(self) -> str:
        """``torch 2.14.1+cu130 (CUDA 13.0 build)`` / ``torch 2.14.1+cpu (CPU-only build)``."""
        kind = f"CUDA {self.torch_cuda} build" if self.torch_cuda else "CPU-only build"
        return f"torch {self.torch_version} ({kind})"


def _release(version: str) -> Optional[tuple[int, ...]]:
    """The leading numeric release of a version string: ``2.6.0a0+git`` -> (2, 6, 0)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def torch_version_problem(version: str) -> Optional[str]:
    """Why torch ``version`` is unsupported, or None when it is inside :data:`SUPPORTED_TORCH`."""
    release = _release(version)
    low, high = SUPPORTED_TORCH_RANGE
    if release is not None and low <= release[:2] < high:
        return None
    return (
        f"torch {version} is outside the supported range torch{SUPPORTED_TORCH} (megatron-core 0.19 needs >= 2.6; "
        f"2.14.1 and 2.11.0 have been run): install a torch in that range (pip install 'torch{SUPPORTED_TORCH}' "
        f"built for this node's CUDA driver)"
    )


def gpus_hidden(cuda_visible_devices: Optional[str]) -> bool:
    """True when ``CUDA_VISIBLE_DEVICES`` hides every GPU on purpose: empty, or ``-1`` first (CUDA
    stops reading the list at the first invalid entry), or Slurm's ``NoDevFiles`` (as
    ``launch/launch.py`` reads it)."""
    if cuda_visible_devices is None:
        return False
    value = cuda_visible_devices.strip()
    return value == "" or value.split(",")[0].strip() in ("-1", "NoDevFiles")


def _driver_too_old(torch_cuda: Optional[str], driver: Optional[str]) -> Optional[str]:
    """``CUDA 13.0, which needs driver >= 580.65.06`` when ``driver`` is older than the build's CUDA needs."""
    cuda, found = _release(torch_cuda or ""), _release(driver or "")
    if not cuda or not found or cuda[0] not in MIN_DRIVER_FOR_CUDA:
        return None
    needed = MIN_DRIVER_FOR_CUDA[cuda[0]]
    if found >= _release(needed):
        return None
    return f"CUDA {torch_cuda}, which needs NVIDIA driver >= {needed}"


def accelerator_problem(facts: AcceleratorFacts) -> Optional[str]:
    """Why this process must not start (the ``ConfigError`` message), or None.

    In order: torch outside :data:`SUPPORTED_TORCH` is an error anywhere; GPUs hidden on purpose
    (``CUDA_VISIBLE_DEVICES`` empty or ``-1``), torch seeing CUDA, or no sign of a GPU are fine;
    otherwise GPUs are visible that torch cannot use -- an error naming the build, the driver and
    what to do.
    """
    version_problem = torch_version_problem(facts.torch_version)
    if version_problem is not None:
        return version_problem
    if gpus_hidden(facts.cuda_visible_devices) or facts.cuda_available:
        return None
    evidence = list(facts.gpu_evidence)
    if facts.cuda_visible_devices is not None:
        evidence.append(f"CUDA_VISIBLE_DEVICES={facts.cuda_visible_devices} names GPUs")
    if not evidence:
        return None  # a machine without GPUs: the CPU is the only device
    driver = (f"this node has NVIDIA driver {facts.driver_version}" if facts.driver_version
              else "the NVIDIA driver version is unknown (no nvidia-smi, no /proc/driver/nvidia/version)")
    if not facts.torch_cuda:
        cause = f"{facts.torch_build} cannot use a GPU"
    else:
        too_old = _driver_too_old(facts.torch_cuda, facts.driver_version)
        cause = (f"{facts.torch_build} is built for {too_old}" if too_old
                 else f"{facts.torch_build} could not initialise CUDA")
    said = f" (torch said: {facts.torch_warning.strip()})" if facts.torch_warning.strip() else ""
    return (
        f"this node has GPUs ({'; '.join(evidence)}) but torch.cuda.is_available() is False, so the run would "
        f"silently fall back to the CPU. {cause}; {driver}{said}. To fix: {WHAT_TO_DO}"
    )


# ---------------------------------------------------------------------------------- detection
def _nvidia_smi(timeout: float) -> tuple[list[str], Optional[str]]:
    """GPU names and the driver version from ``nvidia-smi``; ([], None) where it is missing or fails."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return [], None
    try:
        proc = subprocess.run([binary, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return [], None
    if proc.returncode != 0:
        return [], None
    names, driver = [], None
    for line in proc.stdout.splitlines():
        name, _, version = (part.strip() for part in line.rpartition(","))
        if name:
            names.append(name)
            driver = driver or version or None
    return names, driver


def _proc_driver(root: Path) -> tuple[list[str], Optional[str]]:
    """GPU entries of ``/proc/driver/nvidia/gpus`` and the version in ``/proc/driver/nvidia/version``."""
    gpus_dir, version_file = root / "proc/driver/nvidia/gpus", root / "proc/driver/nvidia/version"
    try:
        gpus = sorted(p.name for p in gpus_dir.iterdir())
    except OSError:
        gpus = []
    driver = None
    try:
        match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", version_file.read_text())
        driver = match.group(1) if match else None
    except OSError:
        pass
    return gpus, driver


def _device_nodes(root: Path) -> list[str]:
    try:
        return sorted(p.name for p in (root / "dev").iterdir() if re.fullmatch(r"nvidia\d+", p.name))
    except OSError:
        return []


def node_gpu_facts(root: Path = Path("/"), timeout: float = NVIDIA_SMI_TIMEOUT_S) -> tuple[tuple[str, ...], Optional[str]]:
    """(evidence phrases, driver version) from nvidia-smi, /proc/driver/nvidia and /dev; ``root``
    lets tests point at a fake tree."""
    evidence = []
    names, driver = _nvidia_smi(timeout)
    if names:
        listed = ", ".join(sorted(set(names)))
        evidence.append(f"nvidia-smi lists {len(names)} GPU{'s' if len(names) > 1 else ''} ({listed})")
    proc_gpus, proc_version = _proc_driver(root)
    if proc_gpus:
        evidence.append(f"/proc/driver/nvidia/gpus has {len(proc_gpus)} entr{'ies' if len(proc_gpus) > 1 else 'y'}")
    nodes = _device_nodes(root)
    if nodes:
        evidence.append(f"/dev/{nodes[0]} exists")
    return tuple(evidence), driver or proc_version


def torch_facts() -> AcceleratorFacts:
    """The torch half of the facts (no node probing)."""
    import torch  # here, not at the top: the decision functions serve scripts whose python may lack torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    said = " ".join(str(w.message) for w in caught if "cuda" in str(w.message).lower())
    return AcceleratorFacts(torch_version=str(torch.__version__), torch_cuda=torch.version.cuda, cuda_available=available,
                            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), torch_warning=said)


def detect(root: Path = Path("/")) -> AcceleratorFacts:
    """Every fact: torch's (the only CUDA call is ``torch.cuda.is_available()``) and the node's."""
    facts = torch_facts()
    evidence, driver = node_gpu_facts(root)
    return replace(facts, gpu_evidence=evidence, driver_version=driver)


def check_accelerator() -> AcceleratorFacts:
    """Raise :class:`ConfigError` when :func:`accelerator_problem` finds one; returns the facts.

    Call it first in every entry point, before any process group or data work. The node is probed
    (nvidia-smi, /proc, /dev) only where the answer depends on it: not when torch sees CUDA, the
    GPUs are hidden on purpose, or torch is out of range."""
    facts = torch_facts()
    if not (facts.cuda_available or gpus_hidden(facts.cuda_visible_devices) or torch_version_problem(facts.torch_version)):
        evidence, driver = node_gpu_facts()
        facts = replace(facts, gpu_evidence=evidence, driver_version=driver)
    problem = accelerator_problem(facts)
    if problem is not None:
        raise ConfigError(problem)
    return facts
