"""Activation bytes kept for backward: measured with saved-tensor hooks, predicted term by term by
the memory model; equal byte for byte for computing and sharing layers (qk and kv sharing, fp32
and bf16), and the model's computing-minus-sharing difference equals the hand formula. Under
TP=2 (+/- sequence parallelism) one launch also measures what a split backward's deferred
weight-gradient GEMMs hold from B to W against the model's weight-gradient terms (and, as the
suite's TP=2 world of one tiny model, a step's token count against a hand count)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from epas_megatron.metrics.memory_model import (
    layer_activation_bytes,
    layer_activation_tensors,
    layer_activation_terms,
    region_saving_bytes,
    weight_grad_bytes,
    weight_grad_terms,
)
from epas_megatron.metrics.rank_memory import embedding_activation_bytes, head_activation_bytes, head_weight_grad_bytes
from epas_megatron.model.architecture import LlamaArchitecture, ModelShape
from epas_megatron.model.moc_sizes import MoCSettings

pytestmark = pytest.mark.usefixtures("single_process")

S, B = 48, 2
ARCH = LlamaArchitecture(num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=352,
                         vocab_size=512, max_sequence_length=S)
SHAPE = ModelShape(ARCH, S, B)


def measured(share, precision):
    from epas_megatron.metrics.activation_memory import measure_saved_bytes
    from epas_testing import build

    model = build(ARCH, (2, 3), share=share, precision=precision)
    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    return measure_saved_bytes(model, tokens, torch.arange(S).expand(B, S), None, labels=tokens)


@pytest.mark.parametrize("share", ["qk", "kv"])
@pytest.mark.parametrize("precision,element_bytes", [("fp32", 4), ("bf16", 2)])
def test_measured_bytes_equal_the_model_per_layer_role(share, precision, element_bytes):
    got = measured(share, precision)
    compute = layer_activation_bytes(SHAPE, "compute", share, element_bytes)
    sharing = layer_activation_bytes(SHAPE, "share", share, element_bytes)
    assert got.layers == {0: compute, 1: compute, 2: sharing, 3: sharing}
    # Outside the layers: the embedding's token ids, the final norm, fp32 logits, the loss's targets.
    assert got.outside == embedding_activation_bytes(SHAPE) + head_activation_bytes(SHAPE, element_bytes)
    # Term by term: the storages each layer kept are the model's tensors, one for one.
    for index, role in ((1, "compute"), (3, "share")):
        assert sorted(got.tensors[index]) == layer_activation_tensors(SHAPE, role, share, element_bytes), (index, role)


def test_sharing_saves_the_qkv_output_rotated_q_k_and_rope_tables_less_its_own_v():
    s, b, a, g, d, e = S, B, 8, 2, 16, 4
    saved = layer_activation_bytes(SHAPE, "compute") - layer_activation_bytes(SHAPE, "share")
    assert saved == e * (s * b * (a + 2 * g) * d + s * b * a * d + s * b * g * d + 4 * s * d - s * b * g * d)
    terms = layer_activation_terms(SHAPE, "compute")
    assert terms["norm1_input"] == s * b * 128 * e and terms["attention_lse"] == b * a * s * 4
    assert terms["swiglu"] == 3 * s * b * 352 * e and terms["fc1_output"] == 2 * s * b * 352 * e
    baseline, epas = region_saving_bytes(SHAPE, 2)
    assert baseline - epas == 2 * saved


def test_memory_bench_prints_measured_and_modelled_bytes():
    proc = subprocess.run([sys.executable, "-m", "epas_megatron.bench.cli", "memory", "--preset", "tiny", "--region", "2",
                           "--seq-length", "32"], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items()
                               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1][len("BENCH "):])
    assert record["computing_layer_bytes_measured"] == record["computing_layer_bytes_model"]
    assert record["sharing_layer_bytes_measured"] == record["sharing_layer_bytes_model"]
    assert record["sharing_layer_bytes_measured"] < record["computing_layer_bytes_measured"]
    assert 0 < record["decoder_saving_fraction"] < 0.5 and record["layers_equal_within_role"]
    assert "| computing |" in proc.stdout and "terms that differ" in proc.stdout
    # The MLP's choices: measured equal to the model; MLP recompute's cost by hand (fc1 and fc2 again:
    # 2 FLOPs x s 32 x b 1 x 3 x h 64 x f 176); Mixture-of-Channels (top 0.2 of 8 groups) costs no GEMM FLOPs.
    choices = record["mlp_choices"]
    assert all(row["layer_bytes_measured"] == row["layer_bytes_model"] for row in choices.values()), choices
    assert choices["mlp_recompute"]["extra_forward_flops"] == 2 * 32 * 3 * 64 * 176 and choices["moc"]["extra_forward_flops"] == 0
    dense = choices["dense"]["layer_bytes_measured"]
    assert choices["mlp_recompute"]["layer_bytes_measured"] < choices["moc"]["layer_bytes_measured"] < dense


@pytest.mark.parametrize("share", ["qk", "kv"])
def test_selective_recompute_drops_only_the_log_sum_exp(share):
    from epas_megatron.metrics.activation_memory import measure_saved_bytes
    from epas_megatron.model.build_plan import BuildPlan, RecomputeSettings
    from epas_megatron.model.builder import build_model

    plan = BuildPlan.for_region(ARCH, (2, 3), seq_length=S, share=share, recompute=RecomputeSettings("selective"))
    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    got = measure_saved_bytes(build_model(plan, seed=1).chunks[0], tokens, torch.arange(S).expand(B, S), None, labels=tokens)
    compute = layer_activation_bytes(SHAPE, "compute", share, recompute="selective")
    sharing = layer_activation_bytes(SHAPE, "share", share, recompute="selective")
    assert got.layers == {0: compute, 1: compute, 2: sharing, 3: sharing}
    assert layer_activation_bytes(SHAPE, "compute", share) - compute == B * 8 * S * 4 - 4


@pytest.fixture(scope="module")
def tp2_launch():
    """The stdout of ``scripts/activation_bytes.py`` on two ranks (TP=2): one launch for the
    activation bytes and the deferred weight-gradient bytes."""
    from epas_testing import REPO, run_script

    return run_script(REPO / "tests" / "distributed" / "scripts" / "activation_bytes.py", nproc=2).stdout


@pytest.mark.distributed
def test_tensor_and_sequence_parallel_bytes_per_rank_equal_the_model(tp2_launch):
    from epas_testing import json_lines

    results = json_lines(tp2_launch, "RESULT")
    assert len(results) == 4
    for result in results:
        kw = dict(tp=2, sequence_parallel=result["sequence_parallel"])
        compute = layer_activation_bytes(SHAPE, "compute", result["share"], **kw)
        sharing = layer_activation_bytes(SHAPE, "share", result["share"], **kw)
        for layers in result["layers_per_rank"]:
            assert layers == {"0": compute, "1": compute, "2": sharing, "3": sharing}, result
    # Sequence parallelism shrinks only the norm terms and the GEMM inputs they feed.
    plain = layer_activation_bytes(SHAPE, "compute", tp=2)
    sp = layer_activation_bytes(SHAPE, "compute", tp=2, sequence_parallel=True)
    assert plain - sp == 2 * (3 * S * B * 128 * 4 + S * B * 4) // 2


def _bytes_per_gemm(terms: dict[str, int]) -> list[int]:
    """The model's weight-gradient terms of one layer, summed per linear (input + output gradient)."""
    per_linear: dict[str, int] = {}
    for name, value in terms.items():
        linear = name.removesuffix("_grad_output").removesuffix("_input")
        per_linear[linear] = per_linear.get(linear, 0) + value
    return list(per_linear.values())


@pytest.mark.distributed
@pytest.mark.parametrize("moc", [None, MoCSettings(0.25, 4)], ids=["dense", "moc"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_what_a_split_backward_keeps_until_w_per_tensor_parallel_rank(tp2_launch, sequence_parallel, moc):
    """The qk model (layers 0-1 computing, 2-3 sharing, the LM head) on two ranks, its store armed:
    after B each rank holds exactly the deferred GEMMs' bytes -- the model's weight_grad_bytes
    per layer role plus head_weight_grad_bytes, byte for byte, and GEMM by GEMM. Under sequence
    parallelism every GEMM keeps the sequence shard of its full-sequence operand and W gathers it
    again: a column-parallel one (QKV or own V, fc1, the head) its input, a row-parallel one (the
    output projection, fc2; MoC's fc2 too) its output gradient, which arrives all-gathered (its
    reduce-scatter is outside the linear) and is copied to the shard [s/2, b, h] in B. The
    gradients after W are those of the same nodes computed at once, bit for bit."""
    from epas_testing import json_lines

    case = [r for r in json_lines(tp2_launch, "DEFERRED")
            if r["sequence_parallel"] == sequence_parallel and (MoCSettings(*r["moc"]) if r["moc"] else None) == moc]
    assert len(case) == 1, case
    kw = dict(tp=2, sequence_parallel=sequence_parallel, moc=moc)
    roles = ("compute", "compute", "share", "share")
    head = head_weight_grad_bytes(SHAPE, 4, tp=2, sequence_parallel=sequence_parallel)
    modelled = sum(weight_grad_bytes(SHAPE, role, "qk", 4, **kw) for role in roles) + head
    per_gemm = sorted([head] + [b for role in roles for b in _bytes_per_gemm(weight_grad_terms(SHAPE, role, "qk", 4, **kw))])
    for held, gemms, grad_outputs in zip(case[0]["held_per_rank"], case[0]["gemms_per_rank"],
                                         case[0]["grad_output_shapes_per_rank"], strict=True):
        assert len(gemms) == 2 * 4 + 2 * 4 + 1  # QKV (own V), proj, fc1, fc2 per layer; the head
        assert held == modelled, (held, modelled)
        assert sorted(map(sum, gemms)) == per_gemm, (gemms, per_gemm)
        # By hand: the row-parallel GEMMs (output gradient [., b, h = 128]: proj and fc2 of 4 layers)
        # keep the sequence shard [s/2, b, h] under SP, the whole [s, b, h] without; and under SP no
        # GEMM keeps a whole-sequence [s, b, h] tensor (fp32).
        rows = S // 2 if sequence_parallel else S
        assert sorted(tuple(g) for g in grad_outputs if g[-1] == 128) == [(rows, B, 128)] * (2 * 4), grad_outputs
        full_hidden = [g for g in gemms if S * B * 128 * 4 in g]
        assert len(full_hidden) == (0 if sequence_parallel else 2 * 4 + 2 * 4 + 1), gemms
    assert case[0]["grads_differ_per_rank"] == [[], []], case[0]["grads_differ_per_rank"]


@pytest.mark.distributed
def test_a_step_counts_each_token_once_under_tensor_parallelism(tp2_launch):
    """``StepResult.tokens`` (what epas-eval prints) on both TP=2 ranks, of an evaluation and of a
    training step: the loss-mask ones of the batch counted by hand -- 2 micro-batches x 2
    sequences x (48 - 5) unmasked positions -- once, not once per tensor-parallel rank; the loss
    is the masked mean of the model's per-token losses. (Here because this launch is the suite's
    TP=2 world of one tiny model: no launch of its own.)"""
    from epas_testing import json_lines

    (case,) = json_lines(tp2_launch, "TOKENS")
    assert (case["microbatches"], case["masked"]) == (2, 5)
    by_hand = 2 * B * (S - 5)
    assert len(case["per_rank"]) == 2
    for rank in case["per_rank"]:
        assert rank["eval_tokens"] == rank["train_tokens"] == by_hand, rank
        assert rank["eval_loss"] == pytest.approx(rank["reference_loss"], rel=1e-6), rank
        assert rank["train_loss"] == pytest.approx(rank["reference_loss"], rel=1e-6), rank


@pytest.mark.distributed
def test_memory_bench_under_tensor_and_sequence_parallelism():
    """Every configuration's rows (qk/kv x recompute) agree on a TP=2 rank with SP."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                           "epas_megatron.bench.cli", "memory", "--preset", "tiny", "--region", "2", "--seq-length", "32",
                           "--tp", "2", "--sequence-parallel"], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads([l for l in proc.stdout.splitlines() if l.startswith("BENCH ")][-1][len("BENCH "):])
    assert record["tp"] == 2 and record["sequence_parallel"] and len(record["configurations"]) == 4
    for row in record["configurations"]:
        assert row["computing_layer_bytes_measured"] == row["computing_layer_bytes_model"], row
        assert row["sharing_layer_bytes_measured"] == row["sharing_layer_bytes_model"], row
    for name, row in record["mlp_choices"].items():  # MLP recompute and Mixture-of-Channels per TP rank too
        assert row["layer_bytes_measured"] == row["layer_bytes_model"], (name, row)


@pytest.mark.parametrize("argv,message", [(["--region", "9"], "--region must be between 1 and 3 for the tiny preset"),
                                          (["--sequence-parallel"], "--sequence-parallel needs --tp > 1"),
                                          (["--moc-groups", "7"], "--moc-groups 7 must divide --ffn-hidden-size 176")])
def test_memory_bench_bad_input(argv, message):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "epas_megatron.bench.cli", "memory", "--preset", "tiny", *argv],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("precision,element_bytes", [("fp32", 4), ("bf16", 2)])
def test_fused_swiglu_layers_keep_the_models_fused_swiglu_tensors(monkeypatch, precision, element_bytes):
    """Megatron's fused SwiGLU (``bias_activation_fusion``, on by default on a GPU) keeps only
    its input: layers built with it keep the model's ``fused_swiglu=True`` tensors, one for one.
    The kernel's compiled body runs as its eager self here (what autograd keeps is the
    ``autograd.Function``'s choice, not the compiler's; CPU Inductor would take ~20 s)."""
    from megatron.core.fusions import fused_bias_swiglu

    from epas_megatron.model import builder

    eager = getattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable", fused_bias_swiglu.swiglu)
    monkeypatch.setattr(fused_bias_swiglu, "swiglu", eager)
    settings = builder.fusion_settings
    monkeypatch.setattr(builder, "fusion_settings", lambda *a, **k: {**settings(*a, **k), "bias_activation_fusion": True})
    got = measured("qk", precision)
    for index, role in ((1, "compute"), (3, "share")):
        want = layer_activation_tensors(SHAPE, role, "qk", element_bytes, fused_swiglu=True)
        assert sorted(got.tensors[index]) == want, (index, role)
    fused, unfused = (layer_activation_terms(SHAPE, "compute", "qk", element_bytes, fused_swiglu=f)["swiglu"] for f in (True, False))
    assert (fused, unfused) == (S * B * 352 * element_bytes, 3 * S * B * 352 * element_bytes)


def test_fused_norm_keeps_its_input_and_rstd_only():
    """torch's one-kernel CUDA rms_norm (held against the GPU's saved tensors in the GPU suite):
    per norm, the input in the training precision, 1 / rms in fp32, and the output the next GEMM
    keeps -- no fp32 copy, no x / rms (hand count)."""
    s, b, h = S, B, 128
    for e in (4, 2):
        fused = {k: v for k, v in layer_activation_terms(SHAPE, "share", "qk", e, fused_norm=True).items() if k.startswith("norm")}
        assert fused == {f"{n}_{t}": v for n in ("norm1", "norm2")
                         for t, v in (("input", s * b * h * e), ("rstd", s * b * 4), ("output", s * b * h * e))}
        composite = layer_activation_bytes(SHAPE, "compute", "qk", e)
        assert composite - layer_activation_bytes(SHAPE, "compute", "qk", e, fused_norm=True) == 2 * s * b * h * (8 - e)
        assert head_activation_bytes(SHAPE, e) - head_activation_bytes(SHAPE, e, fused_norm=True) == s * b * h * (8 - e)


class _FusedRoPEStandIn(torch.autograd.Function):
    """Transformer Engine's ``FusedRoPEFunc`` (``transformer_engine/pytorch/attention/rope.py``,
    what Megatron-Core's ``fused_apply_rotary_pos_emb`` calls; TE cannot be installed on a CPU
    machine) with torch arithmetic: forward rotates ``t`` by ``freqs`` (fp32, made fp32 if it is
    not) and keeps ``ctx.save_for_backward(freqs, cu_seqlens)`` -- ``cu_seqlens`` None for the
    ``sbhd`` layout --, backward rotates the gradient back by ``-freqs``. What autograd keeps is
    the Function's choice, not its kernel's, so this keeps what TE keeps."""

    saved: list = []
    """The ``freqs`` of every call (the test checks they are one storage)."""

    @staticmethod
    def forward(ctx, t, freqs):
        if freqs.dtype != torch.float32:
            freqs = freqs.float()
        ctx.save_for_backward(freqs, None)
        _FusedRoPEStandIn.saved.append(freqs)
        return _rotate(t, freqs)

    @staticmethod
    def backward(ctx, grad):
        freqs, _ = ctx.saved_tensors
        return _rotate(grad, -freqs), None


def _rotate(t, freqs):
    # t [s, b, n, d], freqs [s, 1, 1, d] (halves equal): t·cos + rotate_half(t)·sin, new storage.
    first, second = t.chunk(2, dim=-1)
    return t * freqs.cos().to(t.dtype) + torch.cat((-second, first), dim=-1) * freqs.sin().to(t.dtype)


def _stand_in_rope(monkeypatch):
    """Layers built from here on run RoPE through the stand-in, as with ``apply_rope_fusion`` on
    (the builder's flag, set the way TE's presence sets it in ``fusion_settings``)."""
    from megatron.core.models.common.embeddings import rope_utils

    from epas_megatron.model import builder

    def fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=False, interleaved=False):
        assert not interleaved
        return _FusedRoPEStandIn.apply(t, freqs)

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", fused_apply_rotary_pos_emb)
    settings = builder.fusion_settings
    monkeypatch.setattr(builder, "fusion_settings", lambda *a, **k: {**settings(*a, **k), "apply_rope_fusion": True})
    monkeypatch.setattr(_FusedRoPEStandIn, "saved", [])


@pytest.mark.parametrize("share", ["qk", "kv"])
@pytest.mark.parametrize("precision,element_bytes", [("fp32", 4), ("bf16", 2)])
def test_fused_rope_layers_keep_the_models_fused_rope_tensors(monkeypatch, share, precision, element_bytes):
    """With fused RoPE a layer keeps no cos/sin tables: its tensors are the model's
    ``fused_rope=True`` ones, one for one; the one table the kernel keeps is the rotary
    embedding's cached ``freqs``, the same storage for every layer (so the measurement charges
    it once, to layer 0) and for the next micro-batch -- the model's resident
    ``rotary_table_bytes``, not a per-micro-batch term."""
    from epas_megatron.metrics.memory_model import rotary_table_bytes

    _stand_in_rope(monkeypatch)
    got = measured(share, precision)
    table = rotary_table_bytes(SHAPE)
    for index, role in ((0, "compute"), (1, "compute"), (2, "share"), (3, "share")):
        want = layer_activation_tensors(SHAPE, role, share, element_bytes, fused_rope=True)
        assert sorted(got.tensors[index]) == sorted(want + [table] * (index == 0)), (index, role)
    saved = _FusedRoPEStandIn.saved
    assert len(saved) == 2 * 2 + (2 if share == "kv" else 0)  # Q and K of each computing layer (and a kv layer's Q)
    assert len({f.untyped_storage().data_ptr() for f in saved}) == 1 and saved[0].untyped_storage().nbytes() == table
    unfused = layer_activation_terms(SHAPE, "compute", share, element_bytes)
    fused = layer_activation_terms(SHAPE, "compute", share, element_bytes, fused_rope=True)
    assert unfused.keys() - fused.keys() == {"rope_tables"} and unfused["rope_tables"] == 4 * S * 16 * element_bytes
    assert fused["q_rope"] == unfused["q_rope"] and fused["k_rope"] == unfused["k_rope"]  # core attention keeps them


def test_the_fused_rope_stand_in_is_rope(monkeypatch):
    """The stand-in computes what the unfused path computes -- loss and every gradient -- so the
    layers measured above run RoPE, not something that keeps less."""
    from epas_testing import build

    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))

    def loss_and_grads():
        model = build(ARCH, (2, 3))
        loss = model(tokens, torch.arange(S).expand(B, S), None, labels=tokens).float().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with pytest.MonkeyPatch.context() as patch:
        _stand_in_rope(patch)
        fused = loss_and_grads()
        assert _FusedRoPEStandIn.saved  # it ran
    unfused = loss_and_grads()
    torch.testing.assert_close(fused[0], unfused[0], rtol=1e-6, atol=1e-6)
    assert fused[1].keys() == unfused[1].keys() and len(fused[1]) > 10
    for name, grad in unfused[1].items():
        torch.testing.assert_close(fused[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("modules", [("mlp",), ("core_attn", "mlp")], ids=["mlp", "core_attn+mlp"])
@pytest.mark.parametrize("precision,element_bytes", [("fp32", 4), ("bf16", 2)])
def test_mlp_recompute_keeps_only_the_mlps_input(modules, precision, element_bytes):
    """``--recompute selective --recompute-modules mlp``: Megatron-Core's checkpoint around the
    MLP keeps its input (the second norm's output, which the layer keeps anyway) and nothing of
    fc1 or SwiGLU -- measured equal to the model, and the model's saving by hand."""
    from epas_megatron.metrics.activation_memory import measure_saved_bytes
    from epas_megatron.model.build_plan import BuildPlan, RecomputeSettings
    from epas_megatron.model.builder import build_model

    plan = BuildPlan.for_region(ARCH, (2, 3), seq_length=S, precision=precision, recompute=RecomputeSettings("selective", modules=modules))
    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    got = measure_saved_bytes(build_model(plan, seed=1).chunks[0], tokens, torch.arange(S).expand(B, S), None, labels=tokens)
    kw = dict(recompute="selective", recompute_modules=modules)
    compute = layer_activation_bytes(SHAPE, "compute", "qk", element_bytes, **kw)
    sharing = layer_activation_bytes(SHAPE, "share", "qk", element_bytes, **kw)
    assert got.layers == {0: compute, 1: compute, 2: sharing, 3: sharing}
    f, e = 352, element_bytes
    saved = layer_activation_bytes(SHAPE, "compute", "qk", element_bytes) - compute
    assert saved == S * B * 2 * f * e + 3 * S * B * f * e + (B * 8 * S * 4 - 4 if "core_attn" in modules else 0)


@pytest.mark.parametrize("topk, groups", [(0.25, 4), (0.2, 8)])
@pytest.mark.parametrize("precision,element_bytes", [("fp32", 4), ("bf16", 2)])
def test_mixture_of_channels_layers_keep_the_models_sparse_term(topk, groups, precision, element_bytes):
    """A Mixture-of-Channels MLP keeps, instead of fc1's output and SwiGLU's three tensors, the
    kept indices and the k-wide values of G and U: measured equal to the model's ``moc_sparse``
    term per layer role, storage by storage; and MLP recompute still keeps only the input."""
    from epas_megatron.metrics.activation_memory import measure_saved_bytes
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model
    from epas_megatron.model.moc_sizes import kept_channels

    plan = BuildPlan.for_region(ARCH, (2, 3), seq_length=S, precision=precision, options=(MoCSettings(topk, groups),))
    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    got = measure_saved_bytes(build_model(plan, seed=1).chunks[0], tokens, torch.arange(S).expand(B, S), None, labels=tokens)
    moc = MoCSettings(topk, groups)
    compute = layer_activation_bytes(SHAPE, "compute", "qk", element_bytes, moc=moc)
    sharing = layer_activation_bytes(SHAPE, "share", "qk", element_bytes, moc=moc)
    assert got.layers == {0: compute, 1: compute, 2: sharing, 3: sharing}
    assert sorted(got.tensors[1]) == layer_activation_tensors(SHAPE, "compute", "qk", element_bytes, moc=moc)
    k = kept_channels(352, groups, topk)  # by hand: uint8 indices (a group is at most 256 channels), two k-wide values
    sparse = layer_activation_terms(SHAPE, "compute", "qk", element_bytes, moc=moc)["moc_sparse"]
    assert sparse == S * B * groups * k * (1 + 2 * element_bytes)
    dense = layer_activation_bytes(SHAPE, "compute", "qk", element_bytes)
    assert dense - compute == S * B * 5 * 352 * element_bytes - S * B * groups * k * (1 + 2 * element_bytes)
