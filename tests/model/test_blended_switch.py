"""The blended switch (--epas-switch-ramp) in the model against the plain-PyTorch reference
(tests/llama_reference.py, whose blending is written from the method's definition): losses and
gradients at every step of both ramps of a tiny schedule, qk and kv sharing; at a = 1 the model
is the switched one (the switch changes the forward pass by nothing) and the blending layer's own
Q/K get no gradient; outside a ramp every layer is as its spec built it."""

import pytest
import torch

import llama_reference as ref
from epas_megatron.model.blending import SwitchRampSettings
from epas_megatron.sharing.ramp import SwitchRamp
from epas_megatron.sharing.schedule import SharingSchedule
from epas_testing import assert_same_gradient, build, per_token_loss, reference_weights

pytestmark = pytest.mark.usefixtures("single_process")

# Switches at 4 (layer 3) and 8 (layer 2); N = 3: a = 1/3, 2/3, 1 at iterations 1-3 and 5-7.
SCHEDULE = SharingSchedule(num_layers=4, interval=4, growth=1, target_layers=2)
RAMP = SwitchRamp(SCHEDULE, 3)
BLENDING = (SwitchRampSettings(3),)  # the ramp's build option: computing layers able to blend


def _loss(model, tokens, labels):
    positions = torch.arange(tokens.size(1)).unsqueeze(0).expand(tokens.size(0), -1)
    return model(tokens, positions, None, labels=labels)


@pytest.mark.parametrize("share", ["qk", "kv"])
def test_every_ramp_step_matches_the_reference(tiny_arch, share):
    from epas_megatron.model.attention import split_qkv_rows
    from epas_megatron.training.ramp import apply_ramp

    torch.manual_seed(0)
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, 24))
    labels = torch.randint(0, tiny_arch.vocab_size, (2, 24))
    models = {region: build(tiny_arch, region, share=share, options=BLENDING) for region in ((), (3,), (2, 3))}
    for iteration in (1, 2, 3, 5, 6, 7):
        step = RAMP.step(iteration)
        region = SCHEDULE.sharing_layers(iteration)
        model = models[region]
        apply_ramp([model], RAMP, iteration, share)
        for p in model.parameters():
            p.grad = None
        ours = _loss(model, tokens, labels)
        ours.sum().backward()
        hf, w = reference_weights(model, tiny_arch, requires_grad=True)
        blend = {layer: step.weight for layer in step.blending}
        expected = per_token_loss(ref.forward(w, tokens, 4, 4, 2, set(region), share, blend=blend), labels)
        expected.sum().backward()
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6, msg=f"iteration {iteration}")
        # The blending layer and the new source train all of Q, K and V (the blend's share scaled by 1 - a).
        for layer in step.hand_off:
            got = split_qkv_rows(model.decoder.layers[layer].self_attention.linear_qkv.weight.grad, ("q", "k", "v"), 2, 2, 16)
            for part in "qkv":
                want = hf[f"model.layers.{layer}.self_attn.{part}_proj.weight"].grad
                if want.norm() == 0:  # a = 1: the blending layer's own Q/K (K/V) take no part
                    assert step.weight == 1.0 and layer in step.blending and part in share and got[part].abs().max() == 0
                else:
                    assert_same_gradient(got[part], want)
        if step.weight == 1.0:  # the forward pass of the switched model, to rounding
            following = models[SCHEDULE.sharing_layers(step.switch)]
            apply_ramp([following], RAMP, step.switch, share)
            torch.testing.assert_close(ours, _loss(following, tokens, labels), rtol=1e-6, atol=1e-6)


def test_outside_a_ramp_every_layer_is_as_built(tiny_arch):
    from epas_megatron.sharing.shape import LayerMode
    from epas_megatron.training.ramp import apply_ramp

    torch.manual_seed(1)
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, 16))
    model = build(tiny_arch, (3,), options=BLENDING)
    plain = _loss(model, tokens, tokens)
    apply_ramp([model], RAMP, 6, "qk")  # layer 2 blends, layer 1 hands on
    assert [layer.epas_mode for layer in model.decoder.layers] == [LayerMode.COMPUTE, LayerMode.SOURCE, LayerMode.SOURCE,
                                                                   LayerMode.SHARE]
    assert not torch.equal(_loss(model, tokens, tokens), plain)  # the negative control: the ramp changes the model
    apply_ramp([model], RAMP, 4, "qk")  # no ramp at 4: back to the spec's layers, bit for bit
    assert [layer.epas_mode for layer in model.decoder.layers] == [LayerMode.COMPUTE, LayerMode.COMPUTE, LayerMode.SOURCE,
                                                                   LayerMode.SHARE]
    assert model.decoder.layers[2].self_attention.blend is None
    assert torch.equal(_loss(model, tokens, tokens), plain)
