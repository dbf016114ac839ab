"""``epas-bench``: throughput benchmarks that print ratios measured in one run.

    epas-bench train --preset small --region 4 --iters 20
    epas-bench train --preset 125m --region 6 --iters 12 --seq-length 512 --micro-batch-size 2
    epas-bench train --preset small --method all --kept-tokens 128
    torchrun --nproc-per-node 2 -m epas_megatron.bench.cli pipeline --preset small --region 4
    torchrun --nproc-per-node 4 -m epas_megatron.bench.cli pipeline --schedule 1f1b v-1f1b v-half v-min --preset small
    epas-bench decode --preset 125m --batch 8 --context 2048
    epas-bench hf-decode --preset 125m --batch 8 --context 2048
    epas-bench quality --scale cpu --output-dir runs/quality
    epas-bench switch --preset 350m --mode both --repeats 2
    epas-bench memory --preset 125m --region 6 --seq-length 512

``train``: baseline vs EPAS with a fixed region, same model and process (see
:mod:`epas_megatron.bench.train_bench`). ``decode``: generation throughput, baseline vs EPAS with
and without probability reuse (see :mod:`epas_megatron.bench.decode_bench`). ``hf-decode``:
transformers ``generate()`` on the EPAS export class, region 0 vs half the layers sharing: tokens/s
and peak cache bytes (see :mod:`epas_megatron.bench.hf_decode_bench`). ``pipeline``: PP=2 baseline
vs EPAS without and with stage rebalancing, plus a model-predicted table for 7B on PP=4/8 (see
:mod:`epas_megatron.bench.pipeline_bench`); with ``--schedule``: 1F1B against the V schedules
(v-1f1b, v-half, v-min) on the same model -- per-rank peak memory, time, the executed bubble, p2p
bytes, the loss -- and a predicted 7B table (see :mod:`epas_megatron.bench.schedule_bench`).
``quality``: the paper's quality claims -- baseline vs EPAS from scratch, continual pretraining
evaluated at every region, an ablation -- as a recipe of training runs with tables and plots (see
:mod:`epas_megatron.experiments.quality`). ``switch``: the cost of one EPAS switch in each
--epas-switch-mode, measured on the trainer, and predicted for 7B (see
:mod:`epas_megatron.bench.switch_bench`). ``memory``: activation bytes of computing and sharing
layers, measured and modelled (see :mod:`epas_megatron.bench.memory_bench`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from epas_megatron.errors import ConfigError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="small", help="model preset")
    p.add_argument("--region", type=int, default=None, help="sharing layers of the EPAS model (default: half the layers)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per model")
    p.add_argument("--blocks", type=int, default=4, help="alternating timed blocks per model")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per model first")
    p.add_argument("--seq-length", type=int, default=None, help="default: the preset's")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--num-microbatches", type=int, default=1, help="micro-batches per iteration")
    p.add_argument("--share", default="qk", choices=["qk", "kv"])
    p.add_argument("--core-attention", default="sdpa", choices=["sdpa", "unfused"], help="attention kernel of local layers")
    p.add_argument("--seed", type=int, default=1234)


def _region(args, preset) -> int:
    """--region (default: half the layers), checked against the preset."""
    region = preset.num_layers // 2 if args.region is None else args.region
    if not 0 < region < preset.num_layers:
        raise ConfigError(f"--region must be between 1 and {preset.num_layers - 1} for the {args.preset} preset")
    return region


def _check_pipeline(args, preset) -> None:
    """--pp / --vpp of ``epas-bench pipeline`` against the preset, before any process group."""
    if args.pp < 2:
        raise ConfigError(f"--pp must be >= 2 for the pipeline bench (it compares stage layouts), got {args.pp}")
    stages = args.pp * (args.vpp or 1)
    if args.vpp is not None and args.vpp < 2:
        raise ConfigError(f"--vpp must be >= 2 when given (leave it out for one chunk per rank), got {args.vpp}")
    if preset.num_layers % stages:
        flag = "--pp x --vpp" if args.vpp else "--pp"
        raise ConfigError(f"{flag} = {stages} stages does not divide the {preset.num_layers} layers of the {args.preset} preset")


METHODS = ("epas", "random-ltd", "both", "moc", "epas-moc")


def _methods(args, seq_length: int) -> tuple[str, ...]:
    """--method parsed; --kept-tokens checked against the sequence."""
    names = METHODS if args.method == "all" else tuple(m.strip() for m in args.method.split(",") if m.strip())
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise ConfigError(f"--method {args.method!r}: choose from {', '.join(METHODS)} or all (comma-separated)")
    if args.kept_tokens is not None and not 0 < args.kept_tokens <= seq_length:
        raise ConfigError(f"--kept-tokens must be between 1 and --seq-length, got {args.kept_tokens}")
    return tuple(dict.fromkeys(names))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from epas_megatron.compat.quiet import quiet_library_noise

    quiet_library_noise()
    parser = argparse.ArgumentParser(prog="epas-bench", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="EPAS vs baseline training throughput")
    _common(train)
    train.add_argument("--tp", type=int, default=1)
    train.add_argument("--pp", type=int, default=1)
    train.add_argument("--method", default="epas",
                       help="variants timed against the baseline, comma-separated: epas, random-ltd, both (EPAS with "
                            "Random-LTD), moc (Mixture-of-Channels MLPs), epas-moc (EPAS with them), or all (default: epas)")
    train.add_argument("--moc-topk", type=float, default=0.2, help="kept fraction of the SwiGLU channels of moc / epas-moc")
    train.add_argument("--moc-groups", type=int, default=8, help="Mixture-of-Channels channel groups")
    train.add_argument("--kept-tokens", type=int, default=None,
                       help="tokens each Random-LTD layer keeps (default: half the sequence)")
    pipe = commands.add_parser("pipeline", help="PP=2: baseline, EPAS without and with rebalancing; with --schedule: "
                                                "1F1B against the V schedules")
    _common(pipe)
    pipe.add_argument("--pp", type=int, default=None, help="pipeline ranks (default 2; with --schedule: the number of processes)")
    pipe.add_argument("--vpp", type=int, default=None)
    pipe.add_argument("--schedule", nargs="+", default=None, metavar="NAME",
                      help="compare these pipeline schedules instead (1f1b, v-1f1b, v-half, v-min) on one model, one "
                           "pipeline rank per process; --iters timed iterations each, taking turns (--blocks is not used); "
                           "--region default half the layers, 0 for none; --num-microbatches default 2p")
    pipe.set_defaults(num_microbatches=None)
    decode = commands.add_parser("decode", help="generation: baseline, EPAS Q/K path, EPAS probability reuse")
    decode.add_argument("--preset", default="125m", help="model preset")
    decode.add_argument("--region", type=int, default=None, help="sharing layers of the EPAS model (default: half the layers)")
    decode.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    decode.add_argument("--context", type=int, default=2048, help="cached positions each decode step attends over")
    decode.add_argument("--new-tokens", type=int, default=16, help="timed decode steps per block")
    decode.add_argument("--blocks", type=int, default=4, help="alternating timed blocks per variant")
    decode.add_argument("--warmup", type=int, default=2, help="untimed decode steps per variant first")
    decode.add_argument("--share", default="qk", choices=["qk", "kv"])
    decode.add_argument("--kv-budget-mb", type=float, default=None,
                        help="KV-cache budget of the fixed-memory serving figure (default: the baseline's cache at --batch)")
    decode.add_argument("--region-kernel", default="none", choices=["none", "torch", "triton"],
                        help="also measure reuse with the region's P.V in one launch")
    decode.add_argument("--seed", type=int, default=1234)
    decode.add_argument("--decode-step", default="auto", choices=["auto", "eager", "static", "cuda-graph"],
                        help="how every variant runs a decode step: auto = a replayed CUDA graph on CUDA, eager elsewhere")
    decode.add_argument("--tie-embeddings", action="store_true",
                        help="the LM head shares the input embedding's weight (the presets untie them)")
    decode.add_argument("--moc-topk", type=float, default=1.0,
                        help="below 1: also time a Mixture-of-Channels model (region 0) keeping this fraction of its MLP "
                             "channels, its decode steps dense-masked and reading only the kept rows of W_down")
    decode.add_argument("--moc-groups", type=int, default=8, help="Mixture-of-Channels channel groups (with --moc-topk)")
    hf_decode = commands.add_parser("hf-decode", help="transformers generate() on the EPAS export: region 0 vs half the layers")
    hf_decode.add_argument("--preset", default="125m", help="model shape (random weights)")
    hf_decode.add_argument("--region", type=int, default=None, help="sharing layers of the EPAS variant (default: half the layers)")
    hf_decode.add_argument("--batch", type=int, default=8, help="sequences generated together")
    hf_decode.add_argument("--context", type=int, default=2048, help="prompt tokens cached before the timed generate()")
    hf_decode.add_argument("--new-tokens", type=int, default=16, help="tokens per timed generate()")
    hf_decode.add_argument("--blocks", type=int, default=3, help="alternating timed blocks per variant")
    hf_decode.add_argument("--share", default="qk", choices=["qk", "kv"])
    hf_decode.add_argument("--reuse-probs", action="store_true", help="the EPAS variant reuses the source's probabilities")
    hf_decode.add_argument("--seed", type=int, default=1234)
    _quality_parser(commands)
    switch = commands.add_parser("switch", help="one EPAS switch: in memory vs through a checkpoint")
    switch.add_argument("--preset", default="tiny", help="model preset (tiny ... 350m on CPU)")
    switch.add_argument("--mode", default="both", choices=["memory", "checkpoint", "both"], help="--epas-switch-mode(s) to measure")
    switch.add_argument("--repeats", type=int, default=2, help="fresh processes per mode (figures are medians)")
    switch.add_argument("--steps", type=int, default=3, help="training iterations before the switch (>= 2)")
    switch.add_argument("--seq-length", type=int, default=128, help="sequence length of the steps")
    switch.add_argument("--micro-batch-size", type=int, default=1)
    switch.add_argument("--seed", type=int, default=1234)
    memory = commands.add_parser("memory", help="activation bytes of computing and sharing layers: measured vs modelled")
    memory.add_argument("--preset", default="small", help="model preset")
    memory.add_argument("--region", type=int, default=None, help="sharing layers (default: half the layers)")
    memory.add_argument("--seq-length", type=int, default=256)
    memory.add_argument("--micro-batch-size", type=int, default=1)
    memory.add_argument("--share", default="qk", choices=["qk", "kv"])
    memory.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    memory.add_argument("--tp", type=int, default=1, help="tensor parallel size: run under torchrun with this many processes")
    memory.add_argument("--sequence-parallel", action="store_true")
    memory.add_argument("--moc-topk", type=float, default=0.2, help="Mixture-of-Channels kept fraction of the MLP comparison")
    memory.add_argument("--moc-groups", type=int, default=8, help="Mixture-of-Channels channel groups (a multiple of --tp)")
    args = parser.parse_args(argv)
    from epas_megatron.runtime.accelerator import check_accelerator

    try:
        check_accelerator()  # a benchmark silently timed on the CPU of a GPU node would mislead
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return ConfigError.exit_code
    if args.command == "decode":
        return _decode(args)
    if args.command == "hf-decode":
        return _hf_decode(args)
    if args.command == "switch":
        return _switch(args)
    if args.command == "memory":
        return _memory(args)
    if args.command == "quality":
        return _quality(args)
    if args.command == "pipeline" and args.schedule is not None:
        return _pipeline_schedules(args)
    if args.command == "pipeline":  # the rebalancing bench's defaults
        args.pp = 2 if args.pp is None else args.pp
        args.num_microbatches = 1 if args.num_microbatches is None else args.num_microbatches

    from epas_megatron.config.presets import get_preset
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed, world_size_from_env

    try:
        preset = get_preset(args.preset)
        region = _region(args, preset)
        tp = getattr(args, "tp", 1)
        if world_size_from_env() % (tp * args.pp):
            raise ConfigError(f"--tp {tp} x --pp {args.pp} does not divide the {world_size_from_env()} processes")
        for name in ("iters", "blocks", "num_microbatches"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
        if args.iters < args.blocks:
            raise ConfigError("--iters must be at least --blocks")
        if args.command == "pipeline":
            _check_pipeline(args, preset)
        methods = _methods(args, args.seq_length or preset.seq_length) if args.command == "train" else ()
        from epas_megatron.bench.common import default_backend

        default_backend()  # an installed Transformer Engine that does not load: one error line, before any work
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return ConfigError.exit_code
    seq = args.seq_length or preset.seq_length
    mbs = args.micro_batch_size or preset.training_defaults.get("micro_batch_size", 1)
    dims = init_distributed(tp, args.pp, getattr(args, "vpp", None), seed=args.seed)
    log = print if dims.is_logging_rank else (lambda *a, **k: None)
    try:
        if args.command == "train":
            from epas_megatron.bench.common import BenchConfig
            from epas_megatron.bench.train_bench import format_record, run_train_bench

            cfg = BenchConfig(args.preset, region, args.iters, args.blocks, args.warmup, seq, mbs,
                             args.num_microbatches, tp=tp, pp=args.pp, share=args.share, seed=args.seed,
                             core_attention=args.core_attention, methods=methods, kept_tokens=args.kept_tokens,
                             moc_topk=args.moc_topk, moc_groups=args.moc_groups)
            record = run_train_bench(cfg, log=log)
        else:
            from epas_megatron.bench.common import BenchConfig
            from epas_megatron.bench.pipeline_bench import run_pipeline_bench
            from epas_megatron.bench.train_bench import format_record

            cfg = BenchConfig(args.preset, region, args.iters, args.blocks, args.warmup, seq, mbs,
                                max(args.num_microbatches, 2 * args.pp), pp=args.pp, vpp=args.vpp,
                                share=args.share, seed=args.seed, core_attention=args.core_attention)
            record = run_pipeline_bench(cfg, log=log)
        log(format_record(record))
    finally:
        destroy_distributed()
    return 0


def _pipeline_schedules(args) -> int:
    """``epas-bench pipeline --schedule ...`` (:mod:`epas_megatron.bench.schedule_bench`)."""
    from epas_megatron.bench.common import default_backend
    from epas_megatron.bench.schedule_bench import ScheduleBenchConfig, check_config, parse_schedules, run_schedule_bench
    from epas_megatron.bench.train_bench import format_record
    from epas_megatron.config.presets import get_preset
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed, world_size_from_env

    try:
        preset = get_preset(args.preset)
        schedules = parse_schedules(args.schedule)
        world = world_size_from_env()
        cfg = ScheduleBenchConfig(args.preset, schedules, preset.num_layers // 2 if args.region is None else args.region,
                                  args.iters, args.warmup, args.seq_length or preset.seq_length,
                                  args.micro_batch_size or preset.training_defaults.get("micro_batch_size", 1),
                                  2 * world if args.num_microbatches is None else args.num_microbatches,
                                  share=args.share, core_attention=args.core_attention, seed=args.seed)
        check_config(cfg, preset.num_layers, world)
        if args.vpp is not None:
            raise ConfigError(f"--vpp {args.vpp}: --schedule places the model chunks itself (two per rank under V "
                              "placement, one under 1f1b); drop --vpp")
        if args.pp is not None and args.pp != world:
            raise ConfigError(f"--pp {args.pp}: with --schedule the pipeline has one rank per process (p = {world} here); "
                              f"drop --pp, or start {args.pp} processes")
        default_backend()  # an installed Transformer Engine that does not load: one error line, before any work
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return ConfigError.exit_code
    dims = init_distributed(1, world, None, seed=args.seed)
    log = (lambda line: print(line, flush=True)) if dims.is_logging_rank else (lambda line: None)
    try:
        record = run_schedule_bench(cfg, log=log)
        log(format_record(record))
    finally:
        destroy_distributed()
    return 0


def _decode(args) -> int:
    from epas_megatron.bench.decode_bench import DecodeBenchConfig, check_config, run_decode_bench
    from epas_megatron.bench.train_bench import format_record
    from epas_megatron.config.presets import get_preset
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed, world_size_from_env

    try:
        preset = get_preset(args.preset)
        if world_size_from_env() != 1:
            raise ConfigError("epas-bench decode runs in one process; do not start it with torchrun")
        cfg = DecodeBenchConfig(args.preset, preset.num_layers // 2 if args.region is None else args.region, args.batch,
                                args.context, args.new_tokens, args.blocks, args.warmup, args.share, args.kv_budget_mb,
                                None if args.region_kernel == "none" else args.region_kernel, args.seed,
                                decode_step=args.decode_step, tie_embeddings=args.tie_embeddings, moc_topk=args.moc_topk,
                                moc_groups=args.moc_groups)
        check_config(cfg, preset.num_layers)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return ConfigError.exit_code
    init_distributed(1, 1, None, seed=args.seed)
    try:
        print(format_record(run_decode_bench(cfg)), flush=True)
    finally:
        destroy_distributed()
    return 0


def _hf_decode(args) -> int:
    from epas_megatron.bench.hf_decode_bench import HfDecodeBenchConfig, check_config, run_hf_decode_bench
    from epas_megatron.bench.train_bench import format_record
    from epas_megatron.config.presets import get_preset

    try:
        cfg = HfDecodeBenchConfig(args.preset, args.region, args.batch, args.context, args.new_tokens, args.blocks,
                                  args.share, args.reuse_probs, args.seed)
        check_config(cfg, get_preset(args.preset).num_layers)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return ConfigError.exit_code
    print(format_record(run_hf_decode_bench(cfg, log=lambda line: print(line, flush=True))), flush=True)
    return 0


def _memory(args) -> int:
    from epas_megatron.bench.memory_bench import MemoryBenchConfig, run_memory_bench
    from epas_megatron.bench.train_bench import format_record
    from epas_megatron.config.presets import get_preset
    from epas_megatron.model.moc_sizes import check_moc_config
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed, world_size_from_env

    try:
        preset = get_preset(args.preset)
        region = _region(args, preset)
        if world_size_from_env() != args.tp:
            raise ConfigError(f"epas-bench memory runs one process per TP rank: --tp {args.tp} under "
                              f"{world_size_from_env()} process(es) (torchrun --nproc-per-node {args.tp})")
        if args.sequence_parallel and args.tp < 2:
            raise ConfigError("--sequence-parallel needs --tp > 1")
        if args.seq_length < 1 or args.micro_batch_size < 1:
            raise ConfigError("--seq-length and --micro-batch-size must be >= 1")
        check_moc_config(args.moc_topk, args.moc_groups, preset.ffn_hidden_size, args.tp, "local")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return ConfigError.exit_code
    dims = init_distributed(args.tp, 1, None, seed=1234)
    log = (lambda line: print(line, flush=True)) if dims.is_logging_rank else (lambda line: None)
    try:
        cfg = MemoryBenchConfig(args.preset, region, args.seq_length, args.micro_batch_size, args.share, args.precision,
                                tp=args.tp, sequence_parallel=args.sequence_parallel, moc_topk=args.moc_topk,
                                moc_groups=args.moc_groups)
        record = run_memory_bench(cfg, log=log)
        log(format_record(record))
    finally:
        destroy_distributed()
    return 0


def _switch(args) -> int:
    from epas_megatron.bench.switch_bench import MODES, SwitchBenchConfig, run_switch_bench
    from epas_megatron.bench.train_bench import format_record
    from epas_megatron.config.presets import get_preset
    from epas_megatron.runtime.distributed import world_size_from_env

    try:
        get_preset(args.preset)
        if world_size_from_env() != 1:
            raise ConfigError("epas-bench switch starts its own processes; do not start it with torchrun")
        if args.repeats < 1:
            raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
        if args.steps < 2:
            raise ConfigError(f"--steps must be >= 2 (the first step is not timed), got {args.steps}")
        if args.seq_length < 1 or args.micro_batch_size < 1:
            raise ConfigError("--seq-length and --micro-batch-size must be >= 1")
        if not os.path.exists("/proc/self/clear_refs"):
            raise ConfigError("epas-bench switch measures memory through Linux's /proc/self (not available here)")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return ConfigError.exit_code
    modes = MODES if args.mode == "both" else (args.mode,)
    cfg = SwitchBenchConfig(args.preset, modes, args.repeats, args.steps, args.seq_length, args.micro_batch_size, args.seed)
    try:
        record = run_switch_bench(cfg, log=lambda line: print(line, flush=True))
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(format_record(record), flush=True)
    return 0


def _quality_parser(commands) -> None:
    from epas_megatron.experiments.quality_plan import DEFAULT_PARTS, PARTS, SCALES

    quality = commands.add_parser("quality", help="the paper's quality claims: loss gap, continual pretraining, ablation")
    quality.add_argument("--scale", default="cpu", choices=list(SCALES),
                         help="recipe size: smoke (CI), cpu (~40 min on 2 cores), 125m / 1b (GPUs), tinyllama (continual only)")
    quality.add_argument("--output-dir", default="runs/quality", help="runs, quality.md, quality.json and plots go here")
    quality.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                         help=f"experiments to run (comma-separated): {', '.join(PARTS)}")
    quality.add_argument("--nproc", type=int, default=1, help="processes per training run (torchrun when > 1)")
    quality.add_argument("--base-checkpoint", default=None,
                         help="continual pretraining from this checkpoint (default: the from-scratch baseline)")
    quality.add_argument("--data", nargs="+", default=None, help="indexed dataset prefixes (default: the embedded corpus)")
    quality.add_argument("--tokenizer-model", default=None, help="with --data: its tokenizer")
    quality.add_argument("--force", action="store_true", help="rerun arms that already finished")
    quality.add_argument("--seeds", default=None,
                         help="from-scratch seeds, comma-separated (default: the scale's, 1234,4321 at cpu); finished "
                              "arms of a seed are reused, so adding a seed runs only its arms")
    quality.add_argument("--switch-rewarm", type=int, default=None, metavar="N",
                         help="--parts rewarm: its runs' --epas-switch-rewarm (default: a quarter of the scale's interval)")
    quality.add_argument("--switch-ramp", type=int, default=None, metavar="N",
                         help="--parts ramp: its runs' --epas-switch-ramp (default: a quarter of the scale's interval)")
    quality.add_argument("--dry-run", action="store_true", help="print the training commands and exit")


def _seeds(text: str) -> tuple[int, ...]:
    """``'1234,4321'`` -> (1234, 4321); a ConfigError naming --seeds for anything else."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        raise ConfigError(f"--seeds {text!r}: give non-negative integers separated by commas, e.g. 1234,4321,2024")
    seeds = tuple(int(item) for item in items)
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: a seed is listed twice (each seed is one run per arm)")
    return seeds


def _quality(args) -> int:
    from pathlib import Path

    from epas_megatron.config.presets import get_preset, too_large_for_the_embedded_corpus
    from epas_megatron.config.schema import EMBEDDED_DATA
    from epas_megatron.experiments.quality import QualityRecipe
    from epas_megatron.experiments.quality_plan import PARTS, SCALES

    try:
        parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
        unknown = sorted(set(parts) - set(PARTS))
        if unknown or not parts:
            raise ConfigError(f"--parts {args.parts!r}: choose among {', '.join(PARTS)}")
        scale = SCALES[args.scale]
        if scale.continual_only and args.base_checkpoint is None:
            raise ConfigError(f"--scale {args.scale} is continual pretraining only: "
                              "give --base-checkpoint (e.g. an epas-convert hf-import)")
        embedded = args.data == [EMBEDDED_DATA]
        if scale.continual_only and (args.data is None or embedded):
            raise ConfigError(f"--scale {args.scale}: give --data and --tokenizer-model (the embedded corpus is a CPU demo)")
        preset = get_preset(scale.preset)
        if args.data is None and too_large_for_the_embedded_corpus(preset.num_layers, preset.hidden_size, preset.num_attention_heads,
                                                                   preset.num_query_groups, preset.ffn_hidden_size):
            raise ConfigError(f"--scale {args.scale} ({scale.preset}) has no --data: give --data PREFIX --tokenizer-model MODEL, "
                              f"or --data {EMBEDDED_DATA} to run it on the embedded demo corpus anyway")
        if args.data is not None and not embedded and args.tokenizer_model is None:
            raise ConfigError("--data needs --tokenizer-model")
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
        seeds = None if args.seeds is None else _seeds(args.seeds)
        for flag, value in (("--switch-rewarm", args.switch_rewarm), ("--switch-ramp", args.switch_ramp)):
            if value is not None and not 1 <= value < scale.epas_interval:
                raise ConfigError(f"{flag} {value}: give 1 to {scale.epas_interval - 1} (below the --epas-interval "
                                  f"{scale.epas_interval} of --scale {args.scale})")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return ConfigError.exit_code
    data_args = [] if args.data is None else ["--data", *args.data]
    if args.tokenizer_model is not None:
        data_args += ["--tokenizer-model", args.tokenizer_model]
    recipe = QualityRecipe(args.scale, Path(args.output_dir), args.nproc, args.base_checkpoint, data_args, parts, args.force,
                           seeds=seeds, rewarm_steps=args.switch_rewarm, ramp_steps=args.switch_ramp,
                           echo=lambda line: print(line, flush=True))
    if args.dry_run:
        for arm in recipe.arms():
            print(f"{arm.name}: {' '.join(recipe.train_command(arm))}")
        return 0
    try:
        recipe.run()
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return ConfigError.exit_code
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
