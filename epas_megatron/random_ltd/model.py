"""Setting Random-LTD's per-step kept-token count on built model chunks."""

from __future__ import annotations

from typing import Optional


def _decoder(chunk):
    module = chunk
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module  # DDP, Float16Module
    return module.decoder


def set_kept_tokens(model_chunks, kept: Optional[int]) -> None:
    """Make every chunk's Random-LTD layers keep ``kept`` tokens in the next training step
    (None, or the sequence length or more: keep all)."""
    for chunk in model_chunks:
        _decoder(chunk).kept_tokens = kept
