"""Is the hand-off right? Per-token logits of a (half-precision, any-device) EPAS model against
the fp32 plain-PyTorch reference (``llama_reference``), with negative controls.

A mean loss hides a wrong hand-off, and so does near-uniform attention: with the usual init
(std 0.02) every attention row is almost uniform, so taking Q/K from the wrong layer changes the
logits by about as much as bf16 rounding does (measured on CPU: 1.5% vs 0.6%). Here the weights
are drawn with std 0.1, where attention is far from uniform, and the check is self-validating:
the model must be within ``TOLERANCE`` of the reference for the right region and share kind, and
the reference for a wrong region (shifted by a layer, none, the wrong source) or the other share
kind must be more than ``SEPARATION`` times that away from the model -- so the tolerance is tight
enough to catch exactly the mistakes it is there for.
"""

from __future__ import annotations

import torch

import llama_reference as ref

TOLERANCE = 0.05
"""Relative error (Frobenius norm over all logits) allowed for bf16 against fp32; measured on
CPU for the shape below: 1.6% (fp16: 0.2%)."""

TOKEN_TOLERANCE = 0.1
"""The same, for the worst single token (norm over its vocabulary row; measured: 3.2%)."""

SEPARATION = 4.0
"""A wrong region must be this many tolerances away (measured on CPU: >= 6)."""

SEQ = 64


def architecture():
    from epas_megatron.model.architecture import LlamaArchitecture

    # GQA (8 query heads in 2 groups), std 0.1: attention far from uniform (see module doc).
    return LlamaArchitecture(num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=2,
                             ffn_hidden_size=352, vocab_size=256, max_sequence_length=SEQ, init_method_std=0.1)


def wrong_variants(sharing: tuple[int, ...], share: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Regions and share kinds a wrong hand-off could silently compute instead."""
    first, last = min(sharing), max(sharing)
    other = "kv" if share == "qk" else "qk"
    return {
        "no sharing": ((), share),
        "region one layer shorter (source one layer deeper)": (tuple(range(first + 1, last + 1)), share),
        "region one layer longer (source one layer shallower)": (tuple(range(first - 1, last + 1)), share),
        f"share {other}": (sharing, other),
    }


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(0))


def reference_logits(state: dict, arch, tokens: torch.Tensor, sharing, share: str) -> torch.Tensor:
    """fp32 CPU logits ``[b, s, v]`` of the reference with our model's weights."""
    from epas_megatron.convert.hf_llama import megatron_to_hf, strip_extra_state

    hf = megatron_to_hf({k: v.detach().float().cpu() for k, v in strip_extra_state(state).items()
                         if torch.is_tensor(v)}, arch)
    weights = ref.weights_from_hf_style(hf, arch.num_layers)
    with torch.no_grad():
        return ref.forward(weights, tokens, arch.num_layers, arch.num_attention_heads, arch.num_query_groups,
                           set(sharing), share)[..., : arch.vocab_size]


def errors(logits: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(relative error over all logits, worst per-token relative error)."""
    diff = logits.float().cpu() - expected
    whole = (diff.norm() / expected.norm()).item()
    per_token = (diff.norm(dim=-1) / expected.norm(dim=-1)).max().item()
    return whole, per_token


def check_handoff(model, state: dict, arch, sharing: tuple[int, ...], share: str) -> dict:
    """Assert the model's per-token logits follow the reference for its region and are far
    from every wrong variant's; returns the measured errors (for the failure message / log)."""
    from epas_megatron.runtime.device import to_compute_device

    batch = tokens()
    positions = torch.arange(SEQ).unsqueeze(0).expand(batch.size(0), -1)
    with torch.no_grad():
        logits = model(*to_compute_device((batch, positions)), None)[..., : arch.vocab_size]
    right = errors(logits, reference_logits(state, arch, batch, sharing, share))
    wrong = {name: errors(logits, reference_logits(state, arch, batch, region, kind))[0]
             for name, (region, kind) in wrong_variants(sharing, share).items()}
    measured = {"right": right, "wrong": wrong}
    assert right[0] < TOLERANCE and right[1] < TOKEN_TOLERANCE, measured
    for name, error in wrong.items():
        assert error > SEPARATION * TOLERANCE, (name, measured)
    return measured
