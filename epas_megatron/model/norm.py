"""RMSNorm for the local backend that also works with sequence parallelism.

Megatron-Core's local norm (``WrappedTorchNorm``) refuses sequence parallelism, which otherwise
needs Transformer Engine or apex. A norm only has to mark its weight ``sequence_parallel`` so
that Megatron all-reduces that weight's gradient over the TP group (each rank saw a slice of
the sequence); the computation is ``torch.nn.functional.rms_norm``, the same kernel as
``torch.nn.RMSNorm`` (so the model is bit-identical to Megatron's local spec).
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(hidden_states, (self.hidden_size,), self.weight, self.eps)
