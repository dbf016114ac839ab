"""What a first GPU run of inference would hit (issue #21, item 4), proven on a CUDA node:

* the bf16 decode engine -- eager steps and the CUDA-graphed fixed-shape step; no region,
  probability reuse with and without the Triton region kernel, the Q/K path, 'kv' sharing --
  logit by logit against Megatron's full forwards of the same model, and against fp32
  arithmetic on the same (bf16-rounded) weights; the fp32 engine (TF32 off: the CPU engine's
  arithmetic) against fp32 full forwards;
* a CUDA-graph replay equal to the same fixed-shape step run eagerly (logits and cache);
* no host synchronisation in a decode step (eager or replayed);
* the Triton region kernel compiled (not interpreted) against an fp64 reference in bf16 and
  fp32: the bf16 ``tl.dot``, the upcast variant, the one-row reduction, positions split over
  programs (chosen by the heuristic on this GPU, and forced);
* the generator on CUDA picking the fp32 model's top tokens;
* ``epas-bench decode`` on CUDA producing a sane record.

Teacher forcing: each row is a prompt and a fixed continuation, fed token by token, so every
step's logits are compared at the same tokens and a near-tie cannot send the two sides down
different paths. Tolerances are stated relative to Megatron's own bf16 forward: the engine in
bf16 may be at most twice as far from fp32 arithmetic as that forward, plus 1 % of the largest
logit.
"""

import os
import subprocess
import sys

import pytest
import torch

from epas_testing import REPO, build, child_environ, json_lines
from host_reads import cuda_syncs as count_syncs

pytestmark = pytest.mark.gpu

PROMPT_LENGTHS = (9, 4, 13)  # one left-padded batch
NEW_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def ieee_fp32():
    """fp32 matmuls at IEEE precision (the fp32 references), whatever an earlier test set."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def _arch():
    from epas_megatron.model.architecture import LlamaArchitecture

    # GQA (8 query heads, 4 KV groups of 32: 2 query rows per group at decode), an init large
    # enough for peaked attention.
    return LlamaArchitecture(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=704,
                             vocab_size=512, max_sequence_length=128, init_method_std=0.1)


def _models(sharing, share="qk"):
    """A bf16 model (in its Float16Module) and an fp32 model holding the same bf16-rounded weights."""
    bf16 = build(_arch(), sharing, share=share, precision="bf16").eval()
    fp32 = build(_arch(), sharing, share=share).eval()
    with torch.no_grad():
        for (name16, p16), (name32, p32) in zip(bf16.module.named_parameters(), fp32.named_parameters()):
            assert name16 == name32
            p32.copy_(p16.float())
    return bf16, fp32


def _sequences(seed=0):
    """Per row: a prompt and a continuation of random tokens (teacher forcing, see module doc)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = _arch().vocab_size
    return [(torch.randint(0, vocab, (n,), generator=gen).tolist(),
             torch.randint(0, vocab, (NEW_TOKENS,), generator=gen).tolist()) for n in PROMPT_LENGTHS]


def _engine_logits(engine, sequences, decode_step="eager", spare=0):
    """The engine's logits ``[b, NEW_TOKENS, vocab]`` after each prompt (one left-padded prefill)
    and after each fed continuation token, decoded with eager, fixed-shape ('static') or
    CUDA-graphed steps; and the cache."""
    from epas_megatron.inference.decode_step import StaticDecodeStep

    longest, batch = max(len(p) for p, _ in sequences), len(sequences)
    cache = engine.new_cache(batch, longest + NEW_TOKENS + spare)
    tokens = torch.zeros(batch, longest, dtype=torch.long)
    for row, (prompt, _) in enumerate(sequences):
        tokens[row, longest - len(prompt):] = torch.tensor(prompt)
        cache.pad[row] = longest - len(prompt)
    logits = [engine.forward(tokens.cuda(), cache)[:, -1]]
    step = None
    if decode_step != "eager":
        step = StaticDecodeStep(engine, cache, graph=decode_step == "cuda-graph")
        assert step.captured == (decode_step == "cuda-graph"), "the CUDA graph capture fell back"
    fed = torch.tensor([continuation for _, continuation in sequences], device="cuda")  # [b, NEW_TOKENS]
    for k in range(NEW_TOKENS - 1):
        out = engine.forward(fed[:, k:k + 1], cache) if step is None else step(fed[:, k:k + 1])
        logits.append(out[:, -1].clone())  # a graph's logits live in its static buffer
    return torch.stack(logits, 1), cache


def _full_logits(model, sequences):
    """The reference: one full forward per row over its prompt and continuation, no cache:
    the logits at the same positions as :func:`_engine_logits`, ``[b, NEW_TOKENS, vocab]``."""
    rows = []
    for prompt, continuation in sequences:
        ids = prompt + continuation[:-1]
        with torch.no_grad():
            logits = model(torch.tensor([ids], device="cuda"), torch.arange(len(ids), device="cuda")[None])[0].float()
        rows.append(logits[len(prompt) - 1:])
    return torch.stack(rows)


CASES = [  # (sharing layers, share, decode attention, region kernel)
    ((), "qk", "qk", None),  # the baseline: no region
    ((2, 3), "qk", "reuse", None),
    ((2, 3), "qk", "reuse", "triton"),
    ((2, 3), "qk", "qk", None),  # the paper's inference: Q K^T over the source's cached K
    ((1, 2, 3), "kv", "qk", None),
]


@pytest.mark.parametrize("decode_step", ["eager", "cuda-graph"])
@pytest.mark.parametrize("sharing, share, attention, kernel", CASES)
def test_bf16_decode_follows_full_forwards_and_fp32_arithmetic(world, sharing, share, attention, kernel, decode_step):
    from epas_megatron.inference.engine import DecodeEngine

    bf16, fp32 = _models(sharing, share)
    sequences = _sequences()
    full16, full32 = _full_logits(bf16, sequences), _full_logits(fp32, sequences)
    ours16, cache = _engine_logits(DecodeEngine(bf16, attention, kernel), sequences, decode_step, spare=5)
    ours32, _ = _engine_logits(DecodeEngine(fp32, attention, kernel), sequences, decode_step)
    assert cache.computing_keys.dtype == torch.bfloat16
    scale = full32.abs().max()
    # fp32 engine = fp32 full forward up to summation order
    assert (ours32 - full32).abs().max() <= 1e-3 * scale
    # bf16 engine: against fp32 arithmetic and against Megatron's bf16 forward, within the bf16
    # forward's own error (x2) plus 1 % of the largest logit
    bf16_error = (full16 - full32).abs().max()
    bound = 2 * bf16_error + 0.01 * scale
    error = (ours16 - full32).abs().max()
    assert error <= bound, (error, bf16_error, scale)
    assert (ours16 - full16).abs().max() <= bound + bf16_error
    # token by token: the bf16 engine's greedy token is the fp32 model's wherever the fp32 top-1
    # leads by more than the error bound, and on at least 80 % of all steps (near-ties aside)
    top2 = full32.topk(2, dim=-1)
    clear = (top2.values[..., 0] - top2.values[..., 1]) > 2 * bound
    chosen = ours16.argmax(-1)
    assert torch.equal(chosen[clear], top2.indices[..., 0][clear])
    assert (chosen == top2.indices[..., 0]).float().mean() >= 0.8


@pytest.mark.parametrize("kernel", [None, "triton"])
def test_cuda_graph_replay_equals_the_fixed_shape_step_run_eagerly(world, kernel):
    """The same kernels on the same inputs: a replay gives the eager step's logits and writes
    the same cache (up to cuBLAS's choice of algorithm inside a capture: a few bf16 ulps)."""
    from epas_megatron.inference.engine import DecodeEngine

    bf16, _ = _models((2, 3))
    engine = DecodeEngine(bf16, "reuse", kernel)
    sequences = _sequences(seed=1)
    graphed, graph_cache = _engine_logits(engine, sequences, "cuda-graph", spare=4)
    static, static_cache = _engine_logits(engine, sequences, "static", spare=4)
    scale = static.abs().max()
    assert (graphed - static).abs().max() <= 0.02 * scale
    for name in ("computing_keys", "computing_values", "sharing_values"):
        ours, theirs = getattr(graph_cache, name).float(), getattr(static_cache, name).float()
        assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max(), name
    assert graph_cache.length == static_cache.length == max(PROMPT_LENGTHS) + NEW_TOKENS - 1


def test_a_decode_step_does_not_synchronise(world):
    from epas_megatron.inference.decode_step import StaticDecodeStep
    from epas_megatron.inference.engine import DecodeEngine

    bf16, _ = _models((2, 3))
    engine = DecodeEngine(bf16, "reuse", "triton")
    cache = engine.new_cache(2, 64)
    engine.forward(torch.randint(0, 512, (2, 8), device="cuda"), cache)
    token = torch.randint(0, 512, (2, 1), device="cuda")
    engine.forward(token, cache)  # warm-up: lazy initialisation, Triton compilation
    assert count_syncs(lambda: engine.forward(token, cache)) == 0
    step = StaticDecodeStep(engine, cache, graph=True)
    assert step.captured
    assert count_syncs(lambda: step(token)) == 0


KERNEL_SHAPES = [  # (L, b, g, m, T_max, length, d)
    (6, 1, 12, 1, 2100, 2048, 64),  # 125m-like at batch 1: one-row reduction, positions split by the heuristic
    (2, 1, 4, 4, 1030, 1024, 128),  # GQA rows (tl.dot), L * d = 256 columns: one d-tile
    (3, 8, 2, 2, 300, 257, 80),  # d not a power of two, a ragged last block
    (5, 2, 2, 4, 20, 17, 24),  # shorter than one block
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_triton_region_kernel_compiled_equals_the_reference(shape, dtype):
    from epas_kernels.region_pv import launch_plan, region_pv_reference, region_pv_triton

    assert os.environ.get("TRITON_INTERPRET") != "1", "this test checks the compiled kernel"
    layers, b, g, m, t_max, length, d = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    probs = torch.softmax(torch.randn(b, g, m, t_max, device="cuda", generator=gen), dim=-1).to(dtype)
    values = torch.randn(layers, b, g, t_max, d, device="cuda", generator=gen).to(dtype)
    exact = region_pv_reference(probs.double(), values.double(), length)  # of the same (rounded) inputs
    # bf16: the output's rounding (2^-8 relative) dominates; fp32: summation order only
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5

    def relative_error(ours):
        return ((ours.double() - exact).abs().max() / exact.abs().max()).item()

    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    plan = launch_plan(layers, b, g, m, d, length, sm_count=sm_count)
    if shape == KERNEL_SHAPES[0] and sm_count > b * g * plan.d_tiles:
        assert plan.one_row and plan.splits > 1, plan  # 24 programs on a GPU with more SMs: split
    variants = [(None, None), (1, None), (4, None)] + ([(None, True), (4, True)] if dtype == torch.bfloat16 else [])
    for splits, upcast in variants:  # upcast None on bf16: the bf16 tl.dot (m > 1) a GPU selects
        ours = region_pv_triton(probs, values, length, splits=splits, upcast=upcast)
        assert ours.dtype == dtype and ours.shape == exact.shape
        assert relative_error(ours) < tolerance, (splits, upcast, relative_error(ours))
    # the PyTorch path (cuBLAS, fp32 accumulation) meets the same bound
    assert relative_error(region_pv_reference(probs, values, length)) < tolerance


def test_generator_on_cuda_picks_the_fp32_models_top_tokens(world):
    """Greedy generation with the default decode step (a CUDA graph for these many steps): each
    generated token's fp32 logit is within the bf16 error bound of the fp32 model's top logit."""
    from epas_megatron.inference.decode_step import resolve_decode_step
    from epas_megatron.inference.generator import Generator

    bf16, fp32 = _models((2, 3))
    generator = Generator(bf16)
    assert resolve_decode_step(generator.decode_step, generator.engine.device, NEW_TOKENS - 1) == "cuda-graph"
    prompts = [prompt for prompt, _ in _sequences(seed=2)]
    results = generator.generate(prompts, max_new_tokens=NEW_TOKENS, eos_id=-1)
    sequences = [(prompt, result.tokens) for prompt, result in zip(prompts, results)]
    assert all(len(tokens) == NEW_TOKENS for _, tokens in sequences)
    full16, full32 = _full_logits(bf16, sequences), _full_logits(fp32, sequences)
    bound = 2 * (full16 - full32).abs().max() + 0.01 * full32.abs().max()
    chosen = full32.gather(-1, torch.tensor([tokens for _, tokens in sequences], device="cuda").unsqueeze(-1)).squeeze(-1)
    assert (full32.max(-1).values - chosen).max() <= 2 * bound


def test_decode_bench_on_cuda_gives_a_sane_record():
    proc = subprocess.run([sys.executable, "-m", "epas_megatron.bench.cli", "decode", "--preset", "small", "--region", "4",
                           "--batch", "2", "--context", "512", "--new-tokens", "8", "--blocks", "2", "--warmup", "2",
                           "--region-kernel", "triton"], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=child_environ())  # not the world fixture's rendezvous (its port is taken)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (record,) = json_lines(proc.stdout, "BENCH")
    assert record["device"] == torch.cuda.get_device_name() and record["precision"] == "bf16"
    assert record["decode_step"] == "cuda-graph" and "cuda-graph decode step" in proc.stdout
    # small: 8 layers, 2 KV groups of 64, bf16 -> 2 * 64 * 2 B = 256 B per cached tensor per token;
    # baseline 8 x (K + V) = 4096 B, region 4 ('qk'): 4 x (K + V) + 4 x V = 3072 B
    assert (record["kv_bytes_per_token_baseline"], record["kv_bytes_per_token_epas"]) == (4096, 3072)
    for key in ("baseline_tokens_per_s", "qk_tokens_per_s", "reuse_tokens_per_s", "reuse_kernel_tokens_per_s",
                "serving_tokens_per_s_baseline", "serving_tokens_per_s_epas"):
        assert record[key] > 0, key
    # a sanity range, not a speed claim
    assert 0.5 < record["ratio_qk"] < 3 and 0.5 < record["ratio_reuse"] < 3, record
    assert 1.0 < record["byte_limit_ratio_qk"] < record["byte_limit_ratio"]
