"""Validation loss of one checkpoint at several sharing regions (``epas-eval``'s measurement).

For each region the model is rebuilt with that region's plan (:func:`epas_megatron.assembly.plan_for_checkpoint`:
the layers ending where the checkpoint's regions end share) and the checkpoint is loaded into it
-- the checkpoint format makes that exact -- then the validation split of the run's data (or
other indexed data) is evaluated with the forward-only schedule, on any TP x PP x DP world.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from megatron.core import parallel_state

from epas_megatron.assembly import plan_for_checkpoint
from epas_megatron.checkpointing.checkpoint import load_checkpoint
from epas_megatron.checkpointing.metadata import CheckpointMeta
from epas_megatron.data.datasets import build_data_iterator, build_gpt_datasets
from epas_megatron.data.sources import prepare_data_sources
from epas_megatron.engine.state import build_training_state
from epas_megatron.engine.step import eval_step, stage_batch_keys
from epas_megatron.errors import ConfigError


def evaluate_regions(args, checkpoint: Path, meta: CheckpointMeta) -> list[dict]:
    """Validation loss per region of ``args.region_list`` (runs inside an initialised process
    group; ``args``: epas-eval's options)."""
    cfg = meta.run_config()
    # Every requested region is checked against the checkpoint (where its regions end) before
    # any data or model work.
    plans = {region: plan_for_checkpoint(meta, region, tp=args.tp, pp=args.pp, precision=args.precision)
             for region in args.region_list}
    data_cfg = cfg.data
    if args.data is not None:
        data_cfg = replace(data_cfg, data=args.data, tokenizer_model=args.tokenizer_model)
    elif data_cfg.tokenizer_model is None and not data_cfg.embedded:
        data_cfg = replace(data_cfg, tokenizer_model=meta.tokenizer_model)
    data = prepare_data_sources(data_cfg)
    t = cfg.training
    dp = parallel_state.get_data_parallel_world_size()
    mbs = args.micro_batch_size or t.micro_batch_size
    batch = args.eval_batch_size or t.global_batch_size
    if batch % (mbs * dp):
        raise ConfigError(f"--eval-batch-size {batch} is not divisible by --micro-batch-size {mbs} x data-parallel size {dp}")
    _, valid = build_gpt_datasets(
        data.prefixes, args.split or data_cfg.split, seq_length=t.seq_length, train_samples=batch,
        valid_samples=batch * args.eval_iters, seed=t.seed, tokenizer=data.tokenizer, cache_dir=data.cache_dir,
    )
    results = []
    for region in args.region_list:
        plan = plans[region]
        state = build_training_state(plan)  # chunks only: no optimizer
        chunks, schedule_seq = state.model, state.schedule_seq_length
        load_checkpoint(checkpoint, chunks, restore_rng=False)
        iterators = [build_data_iterator(valid, mbs, parallel_state.get_data_parallel_rank(), dp, 0, keys=stage_batch_keys(chunk))
                     for chunk in chunks]
        result = eval_step(chunks, iterators, num_microbatches=batch // (mbs * dp) * args.eval_iters,
                           seq_length=schedule_seq, micro_batch_size=mbs)
        results.append({"region": region, "sharing_layers": list(plan.sharing_layers), "lm_loss": result.lm_loss,
                        "ppl": math.exp(min(result.lm_loss, 50.0)), "tokens": result.tokens})
    return results


def markdown_table(results: list[dict], trained: int) -> str:
    """Region | sharing layers | loss | perplexity | vs region 0."""
    base = next((r["lm_loss"] for r in results if r["region"] == 0), None)
    lines = ["| region | sharing layers | val loss | perplexity | loss vs region 0 |", "|---|---|---|---|---|"]
    for r in results:
        layers = f"{r['sharing_layers'][0]}-{r['sharing_layers'][-1]}" if r["sharing_layers"] else "-"
        delta = f"{r['lm_loss'] - base:+.4f}" if base is not None else "n/a"
        mark = " (untrained)" if r["region"] > trained else ""
        lines.append(f"| {r['region']}{mark} | {layers} | {r['lm_loss']:.4f} | {r['ppl']:.2f} | {delta} |")
    return "\n".join(lines)
