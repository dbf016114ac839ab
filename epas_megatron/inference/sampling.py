"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from epas_megatron.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen."""

    temperature: float = 0.0
    """0: greedy (the most likely token); > 0: sample from ``softmax(logits / temperature)``."""

    top_k: int = 0
    """Sample only among the ``top_k`` most likely tokens (0: all)."""

    top_p: float = 1.0
    """Sample only from the smallest set of most likely tokens whose probability reaches
    ``top_p`` (nucleus sampling; 1.0: all)."""

    seed: int = 0
    """Seed of the sampling generator (the same seed and prompts give the same tokens)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise ConfigError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k}: must be >= 0 (0 = no limit)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.greedy and (self.top_k or self.top_p < 1.0):
            raise ConfigError("--top-k / --top-p need --temperature > 0 (temperature 0 is greedy)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """``logits [b, v]`` with everything outside the top-k / top-p sets at ``-inf``."""
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None) -> Tensor:
    """``logits [b, v]`` -> token ids ``[b]``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
