"""More ways to get the hand-off wrong, checked per token like tests/handoff_check.py (its
architecture with weights drawn at std 0.1, its tolerances, the fp32 plain-PyTorch reference
``llama_reference``, negative controls more than ``SEPARATION`` tolerances away):

* :func:`pre_rope_hand_off` makes sources hand on their Q/K (K/V) *before* RoPE -- what a buggy
  implementation would pass (their own attention still uses the rotated ones);
  :func:`check_pre_rope_is_caught`: the logits are then far from the reference, and
  :func:`handoff_check.check_handoff` fails on that model (it can fail on this mistake).
* :func:`check_training_logits`: logits of a model in *training* mode -- with activation recompute
  (selective or full) or Random-LTD dropping tokens -- against the reference (Random-LTD: with the
  kept tokens the model draws, run through the reference's dropping layers; dropping nothing is a
  negative control); with recompute, also the gradients against the same model built without it
  (recompute changes only the backward pass, which replays the forward and its hand-off).
* :data:`BLOCKS_ARCH`, :data:`BLOCKS_SHARING` and :func:`blocks_variants`: two sharing blocks
  (``--epas-blocks 2``), each with its own source, against the regions a wrong block layout would
  compute; :func:`check_logits_follow` checks them.

The CPU suite runs all of it in bf16 and fp32 (tests/model/test_handoff_variants.py), the GPU suite
in bf16 on CUDA (tests/gpu/test_gpu_handoff.py).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Optional

import pytest
import torch

import llama_reference as ref
from epas_testing import per_token_loss
from handoff_check import SEPARATION, SEQ, TOKEN_TOLERANCE, TOLERANCE, architecture, check_handoff, errors, tokens, wrong_variants

KEPT = 40
"""Tokens each Random-LTD layer keeps of the ``SEQ`` (64)."""

LTD_SEED = 7
SAMPLE_IDS = (5, 17)
"""The batch's positions in the training stream, which key the kept-token draws (a host tensor,
as the trainer passes them: drawn on the host, copied to the GPU)."""

GRADIENT_TOLERANCE = 2e-2
"""Relative error (norm over each parameter's gradient) allowed between a model with activation
recompute and the same model without: the replay runs the same kernels on the same inputs, so
only nondeterministic kernels (the flash kernel's backward accumulates with atomics) differ; a
replay with a wrong or missing hand-off is off by O(1)."""

BLOCKS_ARCH = dataclasses.replace(architecture(), num_layers=6, init_method_std=0.15)
"""Six layers; std 0.15, not 0.1: the nearest wrong layout (only the shallow block shares) is then
0.30 from the model in bf16 on CPU (0.21 at std 0.1, too near ``SEPARATION`` tolerances), the
right one 0.028 (per token 0.054-0.067)."""
BLOCKS_SHARING = (1, 2, 4, 5)
"""Two blocks of two (``--epas-blocks 2``, region 4): spans 0-2 and 3-5, sources 0 and 3."""

PRE_ROPE_SEPARATION = 2.0
"""A pre-RoPE hand-off must be this many tolerances from the reference (measured on CPU, region
(2, 3), fp32 and bf16: 0.20 for 'qk', 0.23 for 'kv', i.e. 4 tolerances); twice is ample for
:func:`check_handoff` to fail, which is what matters."""


def blocks_variants(share: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """What a wrong block layout could compute instead of :data:`BLOCKS_SHARING`."""
    other = "kv" if share == "qk" else "qk"
    return {
        "no sharing": ((), share),
        "one block of four (layers 2-5, source 1)": ((2, 3, 4, 5), share),
        "one block spanning both (layer 3 shares too, source 0)": ((1, 2, 3, 4, 5), share),
        "the deep block only": ((4, 5), share),
        "the shallow block only": ((1, 2), share),
        f"share {other}": (BLOCKS_SHARING, other),
    }


@contextmanager
def pre_rope_hand_off():
    """Within it, every source hands on its Q/K (K/V) as projected, before RoPE (a buggy hand-off);
    its own attention still uses the rotated ones. For plain sources (no blend, no Random-LTD)."""
    from epas_megatron.model import attention

    original = attention.ComputingAttention.forward_and_hand_off

    def forward_and_hand_off(self, hidden_states, attention_mask, rotary_pos_emb=None, attention_bias=None,
                             packed_seq_params=None, kept_index=None, incoming=None):
        assert kept_index is None and getattr(self, "blend", None) is None, "the pre-RoPE control is for plain sources"
        # [sq, b, h] -> [sq, b, np, hn], [sq, b, ng, hn], [sq, b, ng, hn]
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        # (copies: the projection's split views, where a kernel may want contiguous tensors)
        raw = tuple(t.contiguous() for t in ((query, key) if self.hand_off == "qk" else (key, value)))
        pos = attention._rope_pair(rotary_pos_emb)
        if pos is not None:
            query, key = self._rope(query, pos[0]), self._rope(key, pos[1])
        output = self._attend_and_project(query, key, value, attention_mask, attention_bias, packed_seq_params)
        return output, raw

    attention.ComputingAttention.forward_and_hand_off = forward_and_hand_off
    try:
        yield
    finally:
        attention.ComputingAttention.forward_and_hand_off = original


def run_logits(model, batch: torch.Tensor, arch, sample_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 logits ``[b, s, v]`` of one model chunk on its device, in whatever mode it is in."""
    from epas_megatron.runtime.device import to_compute_device

    positions = torch.arange(batch.size(1)).unsqueeze(0).expand(batch.size(0), -1)
    kwargs = {} if sample_ids is None else {"sample_ids": sample_ids}
    return model(*to_compute_device((batch, positions)), None, **kwargs)[..., : arch.vocab_size].float()


def reference_weights(state: dict, arch) -> dict:
    """``llama_reference`` weights (fp32, CPU) from a local-layer state dict (any precision or device)."""
    from epas_megatron.convert.hf_llama import megatron_to_hf, strip_extra_state

    hf = megatron_to_hf({k: v.detach().float().cpu() for k, v in strip_extra_state(state).items() if torch.is_tensor(v)}, arch)
    return ref.weights_from_hf_style(hf, arch.num_layers)


def model_weights(model, arch) -> dict:
    """:func:`reference_weights` of a model chunk of local layers."""
    from epas_megatron.runtime.wrapping import unwrap_model

    return reference_weights(unwrap_model(model).state_dict(), arch)


def reference(weights: dict, arch, batch: torch.Tensor, sharing, share: str, kept: Optional[dict] = None) -> torch.Tensor:
    with torch.no_grad():
        return ref.forward(weights, batch, arch.num_layers, arch.num_attention_heads, arch.num_query_groups, set(sharing), share,
                           kept=kept)[..., : arch.vocab_size]


def check_logits_follow(logits: torch.Tensor, weights: dict, arch, batch: torch.Tensor, sharing, share: str,
                        variants: dict, kept: Optional[dict] = None) -> dict:
    """:func:`handoff_check.check_handoff`'s assertions on given logits: within the tolerances of
    the reference for ``(sharing, share, kept)``, more than ``SEPARATION`` tolerances from every
    variant ``{name: (sharing, share[, kept])}``; returns the measured errors."""
    logits = logits.detach()
    right = errors(logits, reference(weights, arch, batch, sharing, share, kept))
    wrong = {name: errors(logits, reference(weights, arch, batch, *variant))[0] for name, variant in variants.items()}
    measured = {"right": right, "wrong": wrong}
    assert right[0] < TOLERANCE and right[1] < TOKEN_TOLERANCE, measured
    for name, error in wrong.items():
        assert error > SEPARATION * TOLERANCE, (name, measured)
    return measured


def check_pre_rope_is_caught(model, arch, sharing, share: str, state: Optional[dict] = None) -> dict:
    """The model hands off right (post-RoPE), and with :func:`pre_rope_hand_off` its logits are
    more than :data:`PRE_ROPE_SEPARATION` tolerances from the reference and from its own right
    logits, so that :func:`check_handoff` fails (and passes again after). ``state``: the reference's weights, where the model's own state
    dict does not map to them (Transformer Engine layers); default the model's."""
    from epas_megatron.runtime.wrapping import unwrap_model

    state = unwrap_model(model).state_dict() if state is None else state
    weights = reference_weights(state, arch)
    batch = tokens()
    expected = reference(weights, arch, batch, sharing, share)
    with torch.no_grad():
        right = run_logits(model, batch, arch)
        with pre_rope_hand_off():
            buggy = run_logits(model, batch, arch)
    measured = {"post-RoPE hand-off": errors(right, expected), "pre-RoPE hand-off": errors(buggy, expected),
                "pre-RoPE vs post-RoPE logits": errors(buggy, right.cpu())}
    assert measured["post-RoPE hand-off"][0] < TOLERANCE, measured
    assert measured["pre-RoPE hand-off"][0] > PRE_ROPE_SEPARATION * TOLERANCE, measured
    assert measured["pre-RoPE vs post-RoPE logits"][0] > PRE_ROPE_SEPARATION * TOLERANCE, measured
    with pre_rope_hand_off(), pytest.raises(AssertionError):
        check_handoff(model, state, arch, sharing, share)
    check_handoff(model, state, arch, sharing, share)  # the patch is gone
    return measured


def build_for_training(arch, sharing, share: str, precision: str, *, recompute=None, random_ltd: bool = False,
                       core_attention: str = "sdpa", blocks: int = 1, seed: int = 5):
    """One model chunk in training mode (Random-LTD: every layer drops, :data:`KEPT` kept)."""
    from epas_megatron.model.build_plan import BuildPlan, RecomputeSettings
    from epas_megatron.model.builder import build_model
    from epas_megatron.model.fusions import KernelAvailability
    from epas_megatron.random_ltd.model import set_kept_tokens
    from epas_megatron.random_ltd.option import RandomLTDSettings
    from epas_megatron.sharing.shape import RegionShape

    ltd = (RandomLTDSettings(tuple(range(arch.num_layers)), seed=LTD_SEED, kernels="torch"),) if random_ltd else ()
    plan = BuildPlan.for_region(arch, sharing, precision=precision, share=share, core_attention=core_attention,
                                shape=RegionShape(arch.num_layers, blocks=blocks),
                                recompute=recompute or RecomputeSettings(), options=ltd)
    # No DDP here, so no main_grad for apex's gradient-accumulation fusion to write into (where apex is installed).
    kernels = dataclasses.replace(KernelAvailability.detect(), apex_gradient_accumulation=False)
    model = build_model(plan, seed=seed, kernels=kernels).chunks[0].train()
    if random_ltd:
        set_kept_tokens([model], KEPT)
    return model


def check_training_logits(arch, sharing, share: str, precision: str, *, recompute=None, random_ltd: bool = False,
                          core_attention: str = "sdpa") -> dict:
    """Training-mode logits against the reference with negative controls (module doc); with
    ``recompute`` (a ``RecomputeSettings``), the gradients against the model without it."""
    from epas_megatron.random_ltd.keyed_draw import kept_token_indices
    from epas_megatron.runtime.wrapping import unwrap_model

    batch = tokens()
    sample_ids = torch.tensor(SAMPLE_IDS) if random_ltd else None
    model = build_for_training(arch, sharing, share, precision, recompute=recompute, random_ltd=random_ltd,
                               core_attention=core_attention)
    logits = run_logits(model, batch, arch, sample_ids)
    weights = model_weights(model, arch)
    variants = {name: (region, kind, None) for name, (region, kind) in wrong_variants(sharing, share).items()}
    kept = None
    if random_ltd:
        index = kept_token_indices(sample_ids, list(range(arch.num_layers)), SEQ, KEPT, LTD_SEED)  # [layers, b, r]
        kept = {layer: index[layer] for layer in range(arch.num_layers)}
        variants = {f"{name}, same tokens dropped": (region, kind, kept) for name, (region, kind, _) in variants.items()}
        variants["no token dropped"] = (sharing, share, None)
    measured = check_logits_follow(logits, weights, arch, batch, sharing, share, variants, kept)
    if recompute is None:
        return measured

    plain = build_for_training(arch, sharing, share, precision, random_ltd=random_ltd, core_attention=core_attention)
    plain_logits = run_logits(plain, batch, arch, sample_ids)
    forward_error = errors(logits.detach(), plain_logits.detach().cpu())[0]
    assert forward_error < 0.2 * TOLERANCE, forward_error  # the same forward: the weights are drawn alike
    labels = torch.roll(batch, -1, dims=1).to(logits.device)
    gradients = []
    for chunk, chunk_logits in ((model, logits), (plain, plain_logits)):
        per_token_loss(chunk_logits, labels).mean().backward()
        gradients.append({name: p.grad.detach().float().cpu() for name, p in unwrap_model(chunk).named_parameters()
                          if p.grad is not None})
    got, want = gradients
    trainable = [name for name, p in unwrap_model(model).named_parameters() if p.requires_grad]
    assert sorted(got) == sorted(want) == sorted(trainable), (sorted(got), sorted(want))
    relative = {name: ((got[name] - want[name]).norm() / want[name].norm()).item() for name in want}
    worst = max(relative, key=relative.get)
    assert relative[worst] < GRADIENT_TOLERANCE, (worst, relative[worst])
    measured["gradients vs no recompute"] = (worst, relative[worst])
    return measured
