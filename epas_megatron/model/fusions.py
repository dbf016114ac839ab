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

import importlib.util
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

_APEX_SOFTMAX = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")
_APEX_GRAD_ACCUMULATION = "fused_weight_gradient_mlp_cuda"
BACKENDS = ("local", "transformer_engine")

_JIT_FLAGS = ("bias_activation_fusion", "bias_dropout_fusion")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def transformer_engine_importable() -> bool:
    """Transformer Engine imports (never install it on a CPU machine: see requirements-gpu.txt)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a TE that cannot load CUDA raises more than ImportError
        return False
    return True


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


def choose_backend(transformer_impl: str, cuda: bool) -> str:
    """The layer backend to load a trained model into on this machine: Transformer Engine where
    the run used it (or left it to 'auto') and it is available here, local layers otherwise --
    checkpoints load into either. (Training refuses an unavailable TE instead:
    :func:`epas_megatron.config.validation.resolve_run`.)"""
    use_te = cuda and transformer_impl != "local" and transformer_engine_importable()
    return "transformer_engine" if use_te else "local"


def triton_compiler_problem(environ: Mapping[str, str] = os.environ, which: Callable[[str], Optional[str]] = shutil.which) -> Optional[str]:
    """None if Triton finds a C compiler for its launcher here, else why not: Triton 3.x takes
    ``$CC`` as given, else ``gcc``, else ``clang`` from ``PATH`` (``_find_compiler``; not ``cc``)."""
    cc = environ.get("CC")
    if cc is not None:
        return None if which(cc) else f"CC={cc!r} is not an executable"
    if which("gcc") or which("clang"):
        return None
    return "no C compiler for Triton's CUDA launcher (CC unset, neither gcc nor clang on PATH)"


def _jit_fuser_problem() -> Optional[str]:
    """On a CUDA machine: None if Megatron's ``jit_fuser`` kernels can be built, else why not."""
    from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu

    compiled = (fused_bias_swiglu.swiglu, fused_bias_dropout.bias_dropout_add_fused_train)
    if not any(hasattr(fn, "_torchdynamo_orig_callable") for fn in compiled):
        return None  # jit_fuser was TorchScript or a no-op when Megatron was imported: nothing to build
    from torch.utils._triton import has_triton

    if not has_triton():
        return "torch.compile has no Triton for this GPU"
    import triton

    knobs = getattr(triton, "knobs", None)
    if getattr(getattr(knobs, "build", None), "impl", None) is not None:
        return None  # a custom build hook instead of the C compiler
    problem = triton_compiler_problem()
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
    """What the memory model (:class:`~epas_megatron.metrics.memory_model.RankMemorySettings`)
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
