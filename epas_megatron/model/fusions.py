"""Which fused kernels a run uses: on where the kernel exists, off where it would crash.

Megatron-Core's ``TransformerConfig`` fusion flags each need a kernel that may or may not be
installed, and a flag set without its kernel fails on the first call (or at construction).
:class:`KernelAvailability` records what this process can load; :func:`fusion_settings` turns
that and the layer backend into the flags -- a pure function, tested for every combination
without a GPU. What is fused where:

* ``bias_activation_fusion`` (SwiGLU), ``bias_dropout_fusion`` (the residual adds): Megatron's
  ``jit_fuser`` kernels (``megatron/core/jit.py``: ``torch.compile`` on torch >= 2.2, applied
  when Megatron is imported, compiled at the first call). On a GPU, Inductor emits Triton
  kernels, and Triton builds its CUDA launcher (``cuda_utils``) with the host's C compiler --
  ``$CC``, else ``gcc``, else ``clang`` (``triton/runtime/build.py: _find_compiler``). Without
  Triton or a compiler these flags are off, with the reason in :func:`describe`, instead of the
  first forward failing inside ``torch.compile`` (the probe does not look for a launcher built
  into Triton's cache by an earlier run: without a compiler the flags are off regardless).
  Turning Megatron's ``jit_fuser`` off would not help: the functions are decorated at import;
  the flags choose the unfused paths.
* ``masked_softmax_fusion``: the fused scale-mask-softmax of Megatron's *unfused* local attention,
  from apex's (or Megatron-LM's) ``scaled_*_softmax_cuda`` extensions. The default local attention
  (:mod:`epas_megatron.model.core_attention`, PyTorch SDPA) and Transformer Engine do not use it.
* ``apply_rope_fusion``: Transformer Engine's fused RoPE (Megatron-Core imports it as
  ``rope_utils.fused_apply_rotary_pos_emb``); usable by local layers too when TE is installed.
* ``gradient_accumulation_fusion``: each weight-gradient GEMM accumulates straight into the fp32
  ``main_grad`` buffer of Megatron's DDP. Transformer Engine's linear layers do it themselves
  (``fuse_wgrad_accumulation``), so with the TE backend it is on for every decoder GEMM, apex
  or not. Megatron-Core's local ``ColumnParallelLinear`` / ``RowParallelLinear`` need apex's
  ``fused_weight_gradient_mlp_cuda`` for it (the column layer refuses to build without it), so
  local layers have it only where apex loads. The LM head is a local ``ColumnParallelLinear`` on
  both backends (as in Megatron-Core's ``GPTModel``): it gets the fusion only with apex
  (:func:`output_layer_gradient_accumulation_fusion`, a per-layer setting, see
  :class:`~epas_megatron.model.gpt.EpasGPTModel`); without, its gradient goes through ``.grad``
  and DDP adds it to ``main_grad``. Why not a TE LM head (``TEColumnParallelLinear``): it cannot
  take the tied embedding weight (no ``skip_weight_param_allocation``, no ``weight=`` in the
  forward), it would give TE checkpoints an LM head with FP8 ``_extra_state`` that local layers
  lack, and Megatron-Core itself keeps the local head (its TE head is for MXFP8 output only).
  A chunk built with the fusion on needs Megatron's DDP (``main_grad``) for a backward pass --
  training always has it; forward-only uses (evaluation, generation, conversion) are unaffected.
* ``persist_layer_norm``: apex's persistent LayerNorm; RMSNorm does not use it, always off.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sysconfig
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from epas_megatron.errors import ConfigError

_APEX_SOFTMAX = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")
_APEX_GRAD_ACCUMULATION = "fused_weight_gradient_mlp_cuda"
BACKENDS = ("local", "transformer_engine")

_JIT_FLAGS = ("bias_activation_fusion", "bias_dropout_fusion")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class TransformerEngineProbe:
    """Whether Transformer Engine is installed here and, if so, whether what the TE layer spec
    needs loads: ``transformer_engine.pytorch`` and Megatron-Core's TE extension (never install
    TE on a CPU machine: see requirements-gpu.txt)."""

    installed: bool
    """A ``transformer_engine`` package is on the path."""

    error: Optional[str] = None
    """Why an installed TE does not load (the exception, one line), or None."""

    @property
    def loads(self) -> bool:
        """Installed, and it loads."""
        return self.installed and self.error is None


@functools.lru_cache(maxsize=None)
def probe_transformer_engine() -> TransformerEngineProbe:
    """Probe this process once: a TE that cannot load its CUDA library or extension raises more
    than ImportError, and a wrong version can break only Megatron's TE extension."""
    if not _importable("transformer_engine"):
        return TransformerEngineProbe(installed=False)
    try:
        import transformer_engine.pytorch  # noqa: F401

        import megatron.core.extensions.transformer_engine  # noqa: F401
    except Exception as error:
        return TransformerEngineProbe(installed=True, error=_one_line(error))
    return TransformerEngineProbe(installed=True)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def transformer_engine_importable() -> bool:
    """Transformer Engine is installed and loads (:func:`probe_transformer_engine`)."""
    return probe_transformer_engine().loads


PRECISIONS = ("fp32", "bf16", "fp16")
"""Training / inference precisions (the parameters' dtype); 'auto' is resolved by
:func:`choose_precision` before a plan is made."""


def choose_precision(requested: str, cuda: bool) -> str:
    """The precision to run: ``requested``, with 'auto' meaning bf16 on a GPU and fp32 on CPU
    (bf16 matmuls on CPU are slow and gain nothing there)."""
    if requested == "auto":
        return "bf16" if cuda else "fp32"
    if requested not in PRECISIONS:
        raise ValueError(f"precision must be 'auto' or one of {PRECISIONS}, got {requested!r}")
    return requested


@dataclass(frozen=True)
class BackendChoice:
    """The decoder layers' backend and why it was chosen (printed at start-up)."""

    backend: str
    """'local' or 'transformer_engine'."""

    reason: str
    """'--transformer-impl local', 'auto: no GPU', ..."""


_REPAIR_TE = "repair it (requirements-gpu.txt) or uninstall it"


def choose_layers(transformer_impl: str, cuda: bool,
                  probe: Callable[[], TransformerEngineProbe] = probe_transformer_engine) -> BackendChoice:
    """The backend of a training run (``--transformer-impl``): 'auto' takes Transformer Engine on
    a GPU node where it is installed, local layers where it is not (or on CPU), and says which.
    A backend that is chosen, or that 'auto' would choose (TE installed), but does not load is a
    ``ConfigError`` naming it and ``--transformer-impl local`` -- never a silent fall-back."""
    if transformer_impl == "local":
        return BackendChoice("local", "--transformer-impl local")
    if transformer_impl not in ("auto", "transformer_engine"):
        raise ConfigError(f"--transformer-impl {transformer_impl!r}: choose one of auto, local, transformer_engine")
    explicit = transformer_impl == "transformer_engine"
    if not cuda:
        if explicit:
            raise ConfigError("--transformer-impl transformer_engine needs a GPU; use --transformer-impl local on CPU")
        return BackendChoice("local", "auto: no GPU")
    te = probe()
    if not te.installed:
        if explicit:
            raise ConfigError("--transformer-impl transformer_engine: Transformer Engine is not installed "
                              "(pip install -r requirements-gpu.txt); use --transformer-impl local")
        return BackendChoice("local", "auto: Transformer Engine is not installed")
    if te.error is not None:
        raise ConfigError(f"--transformer-impl {transformer_impl}: Transformer Engine is installed but does not load "
                          f"({te.error}); {_REPAIR_TE}, or pass --transformer-impl local for local layers")
    return BackendChoice("transformer_engine", "--transformer-impl transformer_engine" if explicit else
                         "auto: Transformer Engine loads on this GPU node")


def choose_backend(transformer_impl: str, cuda: bool,
                   probe: Callable[[], TransformerEngineProbe] = probe_transformer_engine) -> str:
    """The layer backend to load a trained model into on this machine: Transformer Engine where
    the run used it (or left it to 'auto') and it is installed here, local layers where it is
    not -- checkpoints load into either, with the same numbers. An installed TE that does not
    load is a ``ConfigError`` (as in training, :func:`choose_layers`), not a quiet switch."""
    if not cuda or transformer_impl == "local":
        return "local"
    te = probe()
    if te.installed and te.error is not None:
        raise ConfigError(f"Transformer Engine is installed but does not load ({te.error}); {_REPAIR_TE} "
                          "(the checkpoint then loads into local layers)")
    return "transformer_engine" if te.installed else "local"


def triton_compiler_problem(environ: Mapping[str, str] = os.environ, which: Callable[[str], Optional[str]] = shutil.which) -> Optional[str]:
    """None if Triton finds a C compiler for its launcher here, else why not: Triton 3.x takes
    ``$CC`` as given, else ``gcc``, else ``clang`` from ``PATH`` (``_find_compiler``; not ``cc``)."""
    cc = environ.get("CC")
    if cc is not None:
        return None if which(cc) else f"CC={cc!r} is not an executable"
    if which("gcc") or which("clang"):
        return None
    return "no C compiler for Triton's CUDA launcher (CC unset, neither gcc nor clang on PATH)"


def python_headers_problem(include_dir: Optional[str] = None, exists: Callable[[str], bool] = os.path.isfile) -> Optional[str]:
    """None if ``Python.h`` is where Triton's launcher build looks for it (``sysconfig``'s include
    directory, Debian's 'posix_local' scheme read as 'posix_prefix', as ``triton/runtime/build.py``
    does), else why not: a node with a compiler but no Python development headers fails there."""
    if include_dir is None:
        scheme = sysconfig.get_default_scheme()
        include_dir = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    header = os.path.join(include_dir, "Python.h")
    if exists(header):
        return None
    return f"no Python headers for Triton's launcher ({header} is missing; install the python3-dev package of this Python)"


@functools.lru_cache(maxsize=None)
def triton_launch_problem(device: str = "cuda") -> Optional[str]:
    """Compile and launch a trivial Triton kernel on ``device`` (adds 1 to eight values) and
    check its result: None if that works, else why not, in one line. This is what every fusion
    ``torch.compile`` builds goes through -- the kernel's compilation and the launcher's build
    with the host's C compiler and Python headers -- so a node that lacks any part fails here,
    once, instead of inside Inductor at the first forward. Cached per process. Under
    ``TRITON_INTERPRET=1`` (any device) the kernel runs in Triton's interpreter (no build): what
    the CPU tests use to check the kernel itself."""
    import torch

    try:
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(pointer, count, BLOCK: tl.constexpr):
            offsets = tl.arange(0, BLOCK)
            mask = offsets < count
            tl.store(pointer + offsets, tl.load(pointer + offsets, mask=mask) + 1.0, mask=mask)

        values = torch.arange(8, dtype=torch.float32, device=device)
        add_one[(1,)](values, 8, BLOCK=8)
        if not torch.equal(values.cpu(), torch.arange(1, 9, dtype=torch.float32)):
            return "a trivial Triton kernel computed wrong values"
    except Exception as error:  # compiler, headers, driver: whatever the build or launch raises
        return f"a trivial Triton kernel did not build and run ({_one_line(error)})"
    return None


def _jit_fuser_problem(launch: Callable[[], Optional[str]] = triton_launch_problem) -> Optional[str]:
    """On a CUDA machine: None if Megatron's ``jit_fuser`` kernels can be built, else why not --
    Triton, a C compiler (or Triton's custom build hook), Python headers, and finally a trivial
    kernel built and launched (``launch``, :func:`triton_launch_problem`)."""
    from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu

    compiled = (fused_bias_swiglu.swiglu, fused_bias_dropout.bias_dropout_add_fused_train)
    if not any(hasattr(fn, "_torchdynamo_orig_callable") for fn in compiled):
        return None  # jit_fuser was TorchScript or a no-op when Megatron was imported: nothing to build
    from torch.utils._triton import has_triton

    if not has_triton():
        return "torch.compile has no Triton for this GPU"
    import triton

    knobs = getattr(triton, "knobs", None)
    if getattr(getattr(knobs, "build", None), "impl", None) is None:  # else a custom build hook instead of the C compiler
        problem = triton_compiler_problem() or python_headers_problem()
        if problem:
            return f"torch.compile cannot build Triton kernels: {problem}"
    problem = launch()
    return f"torch.compile cannot build Triton kernels: {problem}" if problem else None


@dataclass(frozen=True)
class KernelAvailability:
    """What fused kernels this process can load."""

    cuda: bool
    """A CUDA device is present."""

    te_rope: bool
    """Transformer Engine's fused RoPE is importable (through Megatron-Core)."""

    apex_softmax: bool
    """apex's fused scale-mask-softmax extensions are importable."""

    apex_gradient_accumulation: bool
    """apex's ``fused_weight_gradient_mlp_cuda`` is importable."""

    jit_fuser_problem: Optional[str] = None
    """Why Megatron's ``jit_fuser`` kernels (``torch.compile``) cannot be built here, or None
    (they can, or need no build). Set only on CUDA machines."""

    @classmethod
    def detect(cls) -> "KernelAvailability":
        """Probe this process (imports nothing that could fail on a CPU machine)."""
        import torch

        cuda = torch.cuda.is_available()
        te_rope = False
        if cuda:
            from megatron.core.models.common.embeddings import rope_utils

            te_rope = getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None
        return cls(
            cuda=cuda,
            te_rope=te_rope,
            apex_softmax=cuda and all(_importable(name) for name in _APEX_SOFTMAX),
            apex_gradient_accumulation=cuda and _importable(_APEX_GRAD_ACCUMULATION),
            jit_fuser_problem=_jit_fuser_problem() if cuda else None,
        )


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def fusion_settings(kernels: KernelAvailability, backend: str = "local") -> dict[str, bool]:
    """``TransformerConfig`` fusion flags for the kernels available and the decoder layers'
    ``backend`` ('local' or 'transformer_engine'; see the module doc)."""
    _check_backend(backend)
    cuda = kernels.cuda
    jit = cuda and kernels.jit_fuser_problem is None
    return {
        "bias_activation_fusion": jit,
        "bias_dropout_fusion": jit,
        "masked_softmax_fusion": cuda and kernels.apex_softmax,
        "apply_rope_fusion": cuda and kernels.te_rope,
        "gradient_accumulation_fusion": cuda and (kernels.apex_gradient_accumulation or backend == "transformer_engine"),
        "persist_layer_norm": False,
    }


def output_layer_gradient_accumulation_fusion(kernels: KernelAvailability, backend: str = "local") -> bool:
    """Gradient-accumulation fusion of the LM head, a local ``ColumnParallelLinear`` on both
    backends: only with apex's kernel (the decoder's TE layers need none)."""
    return fusion_settings(kernels, backend)["gradient_accumulation_fusion"] and kernels.apex_gradient_accumulation


def torch_fuses_rms_norm(version: Optional[str] = None) -> bool:
    """torch's ``rms_norm`` runs as one CUDA kernel (``aten::_fused_rms_norm``, torch >= 2.8)
    that keeps its input and ``1 / rms`` for backward; older versions and the CPU compose it in
    fp32."""
    from packaging.version import Version

    if version is None:
        import torch

        version = torch.__version__
    return Version(Version(version).base_version) >= Version("2.8")


def activation_kernels(kernels: KernelAvailability, backend: str = "local") -> dict[str, bool]:
    """What the memory model (:class:`~epas_megatron.metrics.rank_memory.RankMemorySettings`)
    needs to know of the kernels: ``fused_norm`` (torch's CUDA ``rms_norm``) and ``fused_swiglu``
    (``bias_activation_fusion``, as :func:`fusion_settings` sets it)."""
    return {"fused_norm": kernels.cuda and torch_fuses_rms_norm(),
            "fused_swiglu": fusion_settings(kernels, backend)["bias_activation_fusion"]}


ASSUMED_GPU = KernelAvailability(cuda=True, te_rope=False, apex_softmax=False, apex_gradient_accumulation=False)
"""What a plan made away from the GPU (``epas-plan --gpu-memory-gb``) assumes the GPU node has:
the default stack (torch with Triton and a C compiler), no apex, no Transformer Engine."""


def fusion_off_reasons(kernels: KernelAvailability, backend: str = "local") -> dict[str, str]:
    """Why each fusion that would speed a GPU run up is off (flag name -> reason); empty on a
    CPU (nothing there is fused) and where everything is on. ``masked_softmax_fusion`` is left
    out: the default attention kernels (SDPA, TE) do not use it."""
    settings = fusion_settings(kernels, backend)
    if not kernels.cuda:
        return {}
    reasons = {}
    for flag in _JIT_FLAGS:
        if not settings[flag]:
            reasons[flag] = kernels.jit_fuser_problem
    if not settings["apply_rope_fusion"]:
        reasons["apply_rope_fusion"] = "needs Transformer Engine"
    if not settings["gradient_accumulation_fusion"]:
        reasons["gradient_accumulation_fusion"] = "local layers need apex's fused_weight_gradient_mlp_cuda"
    elif not output_layer_gradient_accumulation_fusion(kernels, backend):
        reasons["output_layer_gradient_accumulation_fusion"] = "the LM head is a local layer: needs apex's fused_weight_gradient_mlp_cuda"
    return reasons


def _label(flag: str) -> str:
    return flag.replace("_fusion", "").replace("_", "-")


def describe(settings: dict[str, bool], off_reasons: Optional[Mapping[str, str]] = None) -> str:
    """'fused kernels: rope, bias-activation, ...' for the start-up banner; with
    ``off_reasons`` (:func:`fusion_off_reasons`) also what is off and why, flags that share a
    reason together: '...; off: bias-activation, bias-dropout (torch.compile cannot ...)'."""
    on = [_label(name) for name, value in settings.items() if value]
    line = "fused kernels: " + (", ".join(on) if on else "none")
    if off_reasons:
        by_reason: dict[str, list[str]] = {}
        for flag, reason in off_reasons.items():
            by_reason.setdefault(reason, []).append(_label(flag))
        line += "; off: " + "; ".join(f"{', '.join(labels)} ({reason})" for reason, labels in by_reason.items())
    return line
