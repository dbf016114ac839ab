"""A plain ``transformers`` training step on the export at its region (train mode, labels, the
model's own loss, gradient checkpointing on): loss and every gradient equal those of this
framework's model at the same region on the same batch, mapped to Hugging Face names; the step
then changes the sharing layers' V and the source's Q/K, and no frozen row."""

from dataclasses import replace

import torch

from epas_megatron.config.presets import get_preset
from epas_megatron.convert.hf_llama import megatron_to_hf
from epas_megatron.model.architecture import architecture_from_preset

ARCH = replace(architecture_from_preset(get_preset("tiny")), vocab_size=512)
"""The fixture run's model: the tiny preset with its 512-piece vocabulary."""
SOURCE, SHARING = 1, (2, 3)


def test_a_training_step_at_region_r_has_the_framework_gradients(checkpoint, exported, tokens, load_export, world,
                                                                 framework_model):
    ours = framework_model(checkpoint, 2).train()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses = ours(inputs, torch.arange(inputs.shape[1]).expand_as(inputs), None, labels=labels)  # [b, s] per token
    expected_loss = losses.float().mean()
    expected_loss.backward()
    state = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in ours.named_parameters()}
    expected = megatron_to_hf(state, ARCH)  # frozen rows: zeros

    model = load_export(exported).train()
    model.activation_checkpointing_enable()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = model(input_ids=tokens, labels=tokens).loss  # shifts the labels itself: the same predictions
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    checked = 0
    for name, parameter in model.named_parameters():
        if ".frozen_" in name:
            assert parameter.grad is None
            continue
        torch.testing.assert_close(parameter.grad, expected[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        checked += 1
    assert checked == len(expected) - 2 * len(SHARING)  # every trainable tensor
    for name in [f"model.layers.{i}.self_attn.v_proj.weight" for i in SHARING] + [
            f"model.layers.{SOURCE}.self_attn.{x}_proj.weight" for x in "qk"]:
        assert expected[name].abs().sum() > 0, name

    optimizer.step()
    after = dict(model.named_parameters())
    for name, value in before.items():
        assert torch.equal(after[name], value) == (".frozen_" in name), name
