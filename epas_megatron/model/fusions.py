"""Which fused kernels a run uses: on where the kernel exists, off where it would crash.

Megatron-Core's ``TransformerConfig`` fusion flags each need a kernel that may or may not be
installed, and a flag set without its kernel fails on the first call (or at construction).
:class:`KernelAvailability` records what this process can load; :func:`fusion_settings` turns
that into the flags -- a pure function, tested for every combination without a GPU:

* ``bias_activation_fusion``, ``bias_dropout_fusion``: Megatron's own ``jit_fuser`` (TorchScript /
  ``torch.compile``) kernels; need only CUDA.
* ``masked_softmax_fusion``: the fused scale-mask-softmax of Megatron's *unfused* local attention,
  from apex's (or Megatron-LM's) ``scaled_*_softmax_cuda`` extensions. The default local attention
  (:mod:`epas_megatron.model.core_attention`, PyTorch SDPA) and Transformer Engine do not use it.
* ``apply_rope_fusion``: Transformer Engine's fused RoPE (Megatron-Core imports it as
  ``rope_utils.fused_apply_rotary_pos_emb``); usable by local layers too when TE is installed.
* ``gradient_accumulation_fusion``: weight gradients accumulated straight into the fp32 main-grad
  buffer; Megatron-Core's ``ColumnParallelLinear`` (the LM head, every local layer) requires apex's
  ``fused_weight_gradient_mlp_cuda`` for it, so it is on only where that extension loads.
* ``persist_layer_norm``: apex's persistent LayerNorm; RMSNorm does not use it, always off.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

_APEX_SOFTMAX = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")
_APEX_GRAD_ACCUMULATION = "fused_weight_gradient_mlp_cuda"


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
        )


def fusion_settings(kernels: KernelAvailability) -> dict[str, bool]:
    """``TransformerConfig`` fusion flags for the kernels available (see module doc)."""
    cuda = kernels.cuda
    return {
        "bias_activation_fusion": cuda,
        "bias_dropout_fusion": cuda,
        "masked_softmax_fusion": cuda and kernels.apex_softmax,
        "apply_rope_fusion": cuda and kernels.te_rope,
        "gradient_accumulation_fusion": cuda and kernels.apex_gradient_accumulation,
        "persist_layer_norm": False,
    }


def describe(settings: dict[str, bool]) -> str:
    """'fusions: rope, bias-activation, ...' for the start-up banner."""
    on = [name.replace("_fusion", "").replace("_", "-") for name, value in settings.items() if value]
    return "fused kernels: " + (", ".join(on) if on else "none")
