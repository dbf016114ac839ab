"""What a first GPU run would hit (issue #21, item 4), proven on a CUDA node: Random-LTD's kept
tokens drawn without synchronising (host ids: pinned asynchronous copy; device ids: drawn on the
GPU) and equal to the host draw; layer timing with CUDA events (no synchronisation in the hooks,
a positive mean per layer kind); the fusion flags are what detection says, Megatron's
torch.compile'd kernels build where detection says they can, and a forward/backward with the
detected flags equals one with every fusion off."""

import dataclasses
from contextlib import contextmanager

import pytest
import torch

from host_reads import CUDA_SYNC as SYNC
from host_reads import cuda_syncs as count_syncs

pytestmark = pytest.mark.gpu



@contextmanager
def sync_debug(mode):
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _arch(**kwargs):
    from epas_megatron.model.architecture import LlamaArchitecture

    shape = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=704,
                 vocab_size=512, max_sequence_length=128, init_method_std=0.05)
    return LlamaArchitecture(**{**shape, **kwargs})


def _batch(batch=2, seq=128, vocab=512):
    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda", generator=generator)
    return tokens, torch.arange(seq, device="cuda").unsqueeze(0).expand(batch, seq)


def _kernels_without_grad_accumulation_fusion():
    """Detected kernels for models run without Megatron's DDP (no main_grad to fuse into)."""
    from epas_megatron.model.fusions import KernelAvailability

    return dataclasses.replace(KernelAvailability.detect(), apex_gradient_accumulation=False)


def test_sync_debug_mode_catches_a_sync():
    """The guard the tests below rely on is armed: reading a GPU value back is an error."""
    with sync_debug("error"), pytest.raises(RuntimeError, match=SYNC):
        torch.ones(1, device="cuda").item()


# ---------------------------------------------------------------------------- Random-LTD
def test_random_ltd_draw_needs_no_sync_and_equals_the_host_draw():
    from epas_megatron.random_ltd.keyed_draw import generator_seeds, kept_index, kept_token_indices, uniform_keys

    ids, layers, s, r, seed = torch.arange(5000, 5016), list(range(1, 23)), 2048, 256, 11
    host = kept_token_indices(ids, layers, s, r, seed)  # the per-pair draw, exactly (tests/random_ltd)
    with sync_debug("error"):
        copied = kept_index(ids, layers, s, r, seed, "cuda")  # host ids: drawn on the CPU, async copy
        on_device = ids.pin_memory().to("cuda", non_blocking=True)
        drawn = kept_token_indices(on_device, layers, s, r, seed)  # device ids: drawn on the GPU
    assert copied.is_cuda and drawn.is_cuda
    assert torch.equal(copied.cpu(), host)
    # The GPU draw (int64 wrap-around arithmetic, MT19937, topk) equals the host draw except where
    # the r-th and (r+1)-th keys tie: there it breaks ties by position (tokens.py module doc).
    keys = uniform_keys(generator_seeds(ids, torch.tensor(layers), seed).reshape(-1), s)  # [L * b, s]
    ordered = torch.sort(keys, dim=1).values
    tied = (ordered[:, r - 1] == ordered[:, r]).view(len(layers), len(ids))
    by_position = torch.sort(torch.topk(keys * s + torch.arange(s), r, dim=1, largest=False).indices, dim=1).values
    device = drawn.cpu()
    assert torch.equal(device[~tied], host[~tied])
    assert torch.equal(device[tied], by_position.view(len(layers), len(ids), r)[tied])


def test_random_ltd_block_draws_without_sync_and_trains(world):
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model
    from epas_megatron.random_ltd.keyed_draw import kept_token_indices
    from epas_megatron.random_ltd.model import set_kept_tokens
    from epas_megatron.random_ltd.option import RandomLTDSettings

    plan = BuildPlan.for_region(_arch(), (3,), options=(RandomLTDSettings((1, 2, 3), seed=5, kernels="torch"),))
    model = build_model(plan, seed=3, kernels=_kernels_without_grad_accumulation_fusion()).chunks[0]
    set_kept_tokens([model], 48)
    sample_ids = torch.tensor([40, 41])  # on the host, as forward_step passes them
    with sync_debug("error"):
        index = model.decoder._kept_index(sample_ids, 128, torch.device("cuda"))
    assert torch.equal(index.cpu(), kept_token_indices([40, 41], [1, 2, 3], 128, 48, 5))
    tokens, positions = _batch()
    loss = model(tokens, positions, None, labels=tokens, sample_ids=sample_ids).float().mean()
    loss.backward()
    assert torch.isfinite(loss) and model.decoder.layers[2].mlp.linear_fc1.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------- layer timing
def test_layer_timing_records_events_without_sync(world):
    from epas_megatron.parallel.layer_timing import KINDS, EventClock, LayerTimer
    from epas_testing import build

    model = build(_arch(), (2, 3))
    tokens, positions = _batch()

    def forwards(n=3):
        with torch.no_grad():
            for _ in range(n):
                model(tokens, positions, None, labels=tokens)

    forwards(1)  # warm-up
    untimed = count_syncs(forwards)
    timer = LayerTimer()
    assert isinstance(timer.clock, EventClock)
    timer.attach([model])
    assert count_syncs(forwards) == untimed  # the hooks add no synchronisation
    timer.detach()
    measured = timer.measured()  # reads the events (one wait)
    assert timer.counts == {"compute": 6, "share": 6, "output_layer": 3}
    assert set(measured) == set(KINDS) and all(seconds > 0 for seconds in measured.values()), measured


# ---------------------------------------------------------------------------- fusions
def test_jit_fusions_build_where_detection_says_they_can():
    from megatron.core.fusions import fused_bias_dropout, fused_bias_swiglu

    from epas_megatron.model.fusions import KernelAvailability, fusion_settings, triton_compiler_problem

    kernels = KernelAvailability.detect()
    assert kernels.cuda
    flags = fusion_settings(kernels)
    if kernels.jit_fuser_problem is not None:
        assert not flags["bias_activation_fusion"] and not flags["bias_dropout_fusion"]
        pytest.skip(f"jit fusions off here: {kernels.jit_fuser_problem}")
    assert flags["bias_activation_fusion"] and flags["bias_dropout_fusion"]
    if hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"):
        assert triton_compiler_problem() is None  # torch.compile'd: a compiler was found
    # Megatron's compiled kernels build and compute what the eager code does.
    y = torch.randn(64, 2, 2 * 176, device="cuda", dtype=torch.bfloat16)
    a, b = torch.chunk(y, 2, -1)
    # (one rounding to bf16 against eager's two: within a bf16 step)
    torch.testing.assert_close(fused_bias_swiglu.swiglu(y).float(), (torch.nn.functional.silu(a) * b).float(), rtol=2e-2, atol=1e-3)
    x, residual = torch.randn(64, 2, 256, device="cuda"), torch.randn(64, 2, 256, device="cuda")
    torch.testing.assert_close(fused_bias_dropout.bias_dropout_add_fused_train((x, None), residual, 0.0), x + residual)


def _ddp(chunk, config):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), chunk)


def _step(backend, kernels):
    """Loss and main_grads of one bf16 forward/backward under Megatron's DDP (as in training)."""
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model

    built = build_model(BuildPlan.for_region(_arch(), (3,), precision="bf16", backend=backend), seed=3, kernels=kernels)
    model = _ddp(built.chunks[0], built.config)
    tokens, positions = _batch()
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    grads = {name: p.main_grad.detach().float().clone() for name, p in model.named_parameters() if p.requires_grad}
    return built.config, loss.item(), grads


@pytest.mark.parametrize("backend", ["local", "transformer_engine"])
def test_detected_fusions_train_like_no_fusions(world, backend):
    from epas_megatron.model.fusions import KernelAvailability, fusion_settings, transformer_engine_importable

    if backend == "transformer_engine" and not transformer_engine_importable():
        pytest.skip("Transformer Engine is not installed on this node")
    kernels = KernelAvailability.detect()
    off = KernelAvailability(cuda=True, te_rope=False, apex_softmax=False, apex_gradient_accumulation=False,
                             jit_fuser_problem="off for the comparison")
    config, fused_loss, fused_grads = _step(backend, kernels)
    for name, value in fusion_settings(kernels, backend).items():
        assert getattr(config, name) == value, name
    # TE layers fuse the weight-gradient accumulation without apex
    assert config.gradient_accumulation_fusion == (backend == "transformer_engine" or kernels.apex_gradient_accumulation)
    unfused_config, loss, grads = _step(backend, off)
    assert not unfused_config.bias_activation_fusion and (backend == "transformer_engine") == unfused_config.gradient_accumulation_fusion
    assert abs(fused_loss - loss) <= 1e-2 * abs(loss), (fused_loss, loss)
    assert fused_grads.keys() == grads.keys()
    for name, grad in grads.items():  # every weight got its gradient (fused GEMMs and the LM head alike)
        assert torch.isfinite(fused_grads[name]).all() and fused_grads[name].abs().sum() > 0, name
        relative = (fused_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert relative < 0.1, (name, float(relative))  # bf16 roundings differ; a lost or doubled gradient is >= 1
