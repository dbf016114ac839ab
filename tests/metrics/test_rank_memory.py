"""Per-rank memory model: parameters counted against a built model, parameter state against a
trained one's tensors, in-flight micro-batches and a whole rank by hand."""

import pytest
import torch

from epas_megatron.metrics.memory_model import layer_activation_bytes
from epas_megatron.metrics.rank_memory import (
    RankMemorySettings,
    in_flight_microbatches,
    layer_parameters,
    parameter_state_bytes,
    rank_memory_bytes,
)
from epas_megatron.model.architecture import LlamaArchitecture, ModelShape

SHAPE = ModelShape(LlamaArchitecture(4, 64, 4, 2, 176, 512, 64), seq_length=64, micro_batch_size=2)


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("share", ["qk", "kv"])
def test_layer_parameters_match_a_built_model(share):
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_testing import build

    model = build(LlamaArchitecture(4, 64, 4, 2, 176, 512, 64), (2, 3), share=share)
    for index, role in ((0, "compute"), (3, "share")):
        params = list(model.decoder.layers[index].parameters())
        trainable, frozen = layer_parameters(SHAPE, role, share)
        assert trainable == sum(p.numel() for p in params if p.requires_grad)
        assert frozen == sum(p.numel() for p in params if not p.requires_grad)


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("tied", [False, True])
def test_rank_parameters_match_a_built_model_with_and_without_tied_embeddings(tied):
    """One rank (PP = 1) holding everything: a tied LM head has no weight of its own."""
    from epas_megatron.metrics.rank_memory import rank_parameters
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_testing import build

    arch = LlamaArchitecture(4, 64, 4, 2, 176, 512, 64, tie_embeddings=tied)
    model = build(arch, (2, 3))
    roles = ["compute", "compute", "share", "share"]
    trainable, frozen = rank_parameters(ModelShape(arch, 64, 2), roles, 0, 1, RankMemorySettings())
    assert trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert frozen == sum(p.numel() for p in model.parameters() if not p.requires_grad)


def test_in_flight_microbatches():
    assert [in_flight_microbatches(r, 4, 1, 8) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches(0, 4, 1, 2) == 2  # never more than the micro-batches
    # interleaved, p=2 v=2, 4 micro-batches: rank 0 warms up 2*1 + 1*2 chunk passes, +1
    assert in_flight_microbatches(0, 2, 2, 4) == 5 / 2 and in_flight_microbatches(1, 2, 2, 4) == 3 / 2


def test_in_flight_microbatches_by_schedule():
    """Named schedules: 1f1b and interleaved as without a name; a V schedule's simulated peak in
    chunk passes over 2 (the paper's units on the busiest rank, Qi et al., NeurIPS 2024)."""
    assert [in_flight_microbatches(r, 4, 1, 8, "1f1b") for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches(0, 2, 2, 4, "interleaved") == 5 / 2
    for name, busiest in (("v-1f1b", 3), ("v-half", 3), ("v-min", 2)):
        assert max(in_flight_microbatches(r, 4, 1, 8, name) for r in range(4)) == busiest
    with pytest.raises(ValueError, match="--pipeline-schedule 'gpipe': choose one of 1f1b, interleaved"):
        in_flight_microbatches(0, 4, 1, 8, "gpipe")


def test_a_v_rank_by_hand():
    """v-min, p = 2, m = 2, one computing layer per V stage, fp32: rank 1 holds stages 1 and 2
    and runs F1.0 F2.0 B2.0 B1.0 F1.1 F2.1 W2.0 W1.0 B2.1 B1.1 W2.1 W1.1. Along it (a = a layer's
    activations, w = what its deferred GEMMs keep from B to W): a, 2a, a + w, 2w, a + 2w,
    2a + 2w (the peak), 2a + w, 2a, a + w, 2w, w, 0 -- in flight (2a + 2w) / 2a, where counting
    passes whole to their W would say 2 (all four chunk passes)."""
    from epas_megatron.metrics.memory_model import weight_grad_bytes
    from epas_megatron.parallel.pipeline_schedule import build_schedule

    assert [str(x) for x in build_schedule("v-min", 2, 2).ranks[1]] == [
        "F1.0", "F2.0", "B2.0", "B1.0", "F1.1", "F2.1", "W2.0", "W1.0", "B2.1", "B1.1", "W2.1", "W1.1"]
    settings = RankMemorySettings(num_microbatches=2, pipeline_schedule="v-min")
    a, w = layer_activation_bytes(SHAPE, "compute"), weight_grad_bytes(SHAPE, "compute")
    got = rank_memory_bytes(SHAPE, [["compute"], ["compute"]], 1, 2, 1, settings)
    assert got["activations"] == 2 * a + 2 * w and got["in_flight"] == (2 * a + 2 * w) / (2 * a)
    assert got["deferred"] == [w, w] and in_flight_microbatches(1, 2, 1, 2, "v-min") == 2


def test_a_rank_by_hand():
    settings = RankMemorySettings(num_microbatches=4, precision="bf16", distributed_optimizer=True, dp=2)
    # PP=2: rank 0 holds the embedding and layers 0-1 (computing), rank 1 layers 2-3 (sharing) and the head.
    first = rank_memory_bytes(SHAPE, [["compute", "compute"]], 0, 2, 1, settings)
    last = rank_memory_bytes(SHAPE, [["share", "share"]], 1, 2, 1, settings)
    s, b, h, d = 64, 2, 64, 16
    c_train, _ = layer_parameters(SHAPE, "compute")
    s_train, s_frozen = layer_parameters(SHAPE, "share")
    per_param = lambda trainable, frozen: (trainable + frozen) * 2 + trainable * 4 + trainable * 12 // 2
    assert first["parameters"] == 2 * per_param(c_train, 0) + per_param(512 * 64, 0)
    assert last["parameters"] == 2 * per_param(s_train, s_frozen) + per_param(512 * 64 + 64, 0)
    act = lambda role: layer_activation_bytes(SHAPE, role, "qk", 2)
    assert first["activations"] == 2 * (2 * act("compute") + s * b * 8)  # 2 in flight on rank 0 of 2
    handoff = s * b * (4 + 2) * d * 2
    head = (2 * s * b * h * 4 + s * b * 4 + s * b * h * 2) + s * b * 512 * 4 + s * b * 9  # fp32 norm, bf16 output
    head += s * b * 4  # the training loss function's fp32 copy of the loss mask
    assert last["activations"] == 1 * (handoff + 2 * act("share") + head)


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameter_state_bytes_match_a_trained_model(precision, tmp_path):
    """Weights + DDP gradient buffer + optimizer state (fp32 main weights and moments) of the
    built objects after one step, against the model's count (within DDP's bucket padding)."""
    from epas_megatron.engine.optimizer import OptimizerSettings
    from epas_megatron.engine.state import build_training_state
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.model.build_plan import BuildPlan

    arch = LlamaArchitecture(4, 64, 4, 2, 176, 512, 64)
    plan = BuildPlan.for_region(arch, (3,), seq_length=64, precision=precision)
    settings = OptimizerSettings(lr=1e-3, min_lr=0.0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                                 clip_grad=0.0, use_distributed_optimizer=False, overlap_grad_reduce=False, warmup_iters=0,
                                 decay_iters=10, decay_style="constant", precision=precision)
    state = build_training_state(plan, settings, seed=1)
    for p in state.model[0].parameters():  # give every trainable parameter a gradient, then step
        if p.requires_grad:
            p.main_grad.fill_(1e-3)
    state.optimizer.step()
    weights = sum(p.numel() * p.element_size() for p in state.model[0].parameters())
    grads = sum(buffer.grad_data.numel() * buffer.grad_data.element_size() for buffer in state.model[0].buffers)
    optim = 0
    for part in state.optimizer.chained_optimizers:
        for group in part.optimizer.param_groups:
            for p in group["params"]:
                optim += sum(v.numel() * v.element_size() for v in part.optimizer.state[p].values() if torch.is_tensor(v) and v.dim())
                if precision != "fp32":
                    optim += p.numel() * p.element_size()  # the fp32 main weight itself
    shape = ModelShape(arch, 64, 2)
    trainable = sum(layer_parameters(shape, role)[0] for role in ("compute", "compute", "compute", "share")) + 2 * 512 * 64 + 64
    frozen = layer_parameters(shape, "share")[1]
    model = parameter_state_bytes(trainable, frozen, precision)
    assert abs((weights + grads + optim) - model) <= 0.01 * model, (weights, grads, optim, model)


def test_pipeline_messages_by_hand():
    """One message is ``[rows, b, h]``: 64 x 2 x 64 fp32 = 32 KiB; the sequence shard under
    SP at TP = 2; with the qk hand-off (a + g = 6 heads of 16) 6 x 16 x 64 / 64 = 96 rows more (48
    per TP rank under SP). A rank holds the sent messages its plan names: V-Min at p = 4, m = 16
    two on rank 0, one elsewhere; Megatron's own schedules one; a single stage none -- all in
    ``total``."""
    from epas_megatron.metrics.rank_memory import p2p_message_bytes, sent_messages_held

    fp32, sp = RankMemorySettings(), RankMemorySettings(tp=2, sequence_parallel=True)
    assert p2p_message_bytes(SHAPE, fp32, False) == 64 * 2 * 64 * 4
    assert p2p_message_bytes(SHAPE, sp, False) == 32 * 2 * 64 * 4
    assert p2p_message_bytes(SHAPE, fp32, True) == (64 + 96) * 2 * 64 * 4
    assert p2p_message_bytes(SHAPE, sp, True) == (32 + 48) * 2 * 64 * 4
    assert [sent_messages_held("v-min", r, 4, 16) for r in range(4)] == [2, 1, 1, 1]
    assert sent_messages_held("1f1b", 0, 4, 16) == sent_messages_held(None, 0, 4, 16) == 1
    assert sent_messages_held("v-min", 0, 1, 16) == 0
    settings = RankMemorySettings(num_microbatches=16, pipeline_schedule="v-min")
    got = rank_memory_bytes(SHAPE, [["compute"], ["share"]], 0, 4, 2, settings)
    assert got["messages"] == 2 * (64 + 96) * 2 * 64 * 4  # chunk 1 receives the hand-off: the messages carry it
    assert got["total"] == got["parameters"] + got["activations"] + got["messages"]
