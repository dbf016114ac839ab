"""``epas-eval``: validation loss and perplexity of one checkpoint at several sharing regions.

One EPAS-trained model serves many compute budgets: the same weights run with any region length
from 0 (every layer computes with its own, frozen Q/K) to the largest region it was trained with.
For each requested length (a count, ``half`` or ``max`` of the trained region) the layers ending
where the checkpoint's regions end (the last layer, or ``--epas-exclude-last`` layers before it)
share; the model is rebuilt with those specs and the checkpoint loaded into it (the checkpoint
format makes that exact), then the validation split of the training data (or ``--data``) is
evaluated -- or, with ``--lm-eval-tasks``, EleutherAI's lm-evaluation-harness runs at every
region (:mod:`epas_megatron.evaluation.lm_eval_model`; one process).

    epas-eval --load runs/demo/checkpoints --regions 0,2,4
    torchrun --nproc-per-node 2 -m epas_megatron.evaluate --load CKPT --regions 0,4 --tp 2
    epas-eval --load CKPT --regions 0,half,max --lm-eval-tasks hellaswag,arc_easy

Prints a markdown table and a final ``EVAL {json}`` (``LM_EVAL {json}``) line; ``--output FILE``
also writes the JSON.
A region larger than the trained one is an error unless ``--allow-untrained-regions`` (which
measures inference-time sharing on layers that never trained with it, as in the paper's
baseline).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from epas_megatron.config.schema import EMBEDDED_DATA
from epas_megatron.errors import ConfigError

# A command: torch, Megatron and everything built on them are imported inside the functions, so
# that --help and configuration errors answer at once and library warnings are silenced first.


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epas-eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint root (its latest checkpoint) or an iter_NNNNNNN directory")
    p.add_argument("--regions", required=True, help="comma-separated sharing-region lengths, e.g. 0,2,4 ('max' = the trained region)")
    p.add_argument("--eval-iters", type=int, default=8, help="validation batches of --eval-batch-size sequences per region")
    p.add_argument("--eval-batch-size", type=int, default=None, help="sequences per validation batch (default: the run's global batch)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the run's")
    p.add_argument("--data", nargs="+", default=None, help="indexed dataset prefixes to evaluate on (default: the run's data)")
    p.add_argument("--tokenizer-model", default=None, help="with --data: the tokenizer it was made with")
    p.add_argument("--split", default=None, help="train/valid/test split weights (default: the run's); the valid share is evaluated")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--allow-untrained-regions", action="store_true", help="allow regions larger than the trained one")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="model precision ('auto': bf16 on a GPU, fp32 on CPU)")
    p.add_argument("--output", default=None, help="also write the results as JSON here")
    lm = p.add_argument_group("lm-evaluation-harness (instead of the validation loss; needs `pip install lm-eval`)")
    lm.add_argument("--lm-eval-tasks", default=None,
                    help="comma-separated lm_eval task names (e.g. hellaswag,arc_easy): run them at every --regions entry")
    lm.add_argument("--lm-eval-include-path", default=None, help="a directory of custom lm_eval task YAMLs")
    lm.add_argument("--lm-eval-limit", type=int, default=None, help="at most this many documents per task (for quick checks)")
    lm.add_argument("--lm-eval-batch-size", type=int, default=8, help="sequences per forward or generation batch")
    lm.add_argument("--lm-eval-num-fewshot", type=int, default=None, help="few-shot examples per prompt (None: each task's own number)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from epas_megatron.compat.quiet import quiet_library_noise

    quiet_library_noise()
    args = _parser().parse_args(argv)
    try:
        from epas_megatron.assembly import checkpoint_regions
        from epas_megatron.checkpointing.integrity import open_checkpoint
        from epas_megatron.runtime.accelerator import check_accelerator
        from epas_megatron.runtime.distributed import world_size_from_env

        check_accelerator()

        checkpoint, meta = open_checkpoint(args.load, "--load", needs_config=True)
        num_layers, trained = meta.num_layers, meta.trained_region
        args.region_list = checkpoint_regions(meta, args.regions, args.allow_untrained_regions)
        world = world_size_from_env()
        task_manager = check_lm_eval_args(args, world)  # None without --lm-eval-tasks
        if world % (args.tp * args.pp):
            raise ConfigError(f"--tp {args.tp} x --pp {args.pp} does not divide the {world} processes")
        if num_layers % args.pp:
            raise ConfigError(f"--pp {args.pp} does not divide the {num_layers} layers")
        if args.data is not None and args.data != [EMBEDDED_DATA] and args.tokenizer_model is None:
            raise ConfigError("--data needs --tokenizer-model")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    if task_manager is not None:
        return lm_eval_main(args, task_manager)

    from epas_megatron.evaluation.validation_loss import evaluate_regions, markdown_table
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    dims = init_distributed(args.tp, args.pp, None, seed=0)
    try:
        results = evaluate_regions(args, checkpoint, meta)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    finally:
        destroy_distributed()
    if dims.is_logging_rank:
        payload = {"checkpoint": str(checkpoint), "iteration": meta.iteration, "trained_region": trained,
                   "exclude_last": meta.exclude_last, "blocks": meta.blocks, "results": results}
        print(f"checkpoint {checkpoint} (iteration {meta.iteration}, trained region {trained} layers)")
        print(markdown_table(results, trained))
        print("EVAL " + json.dumps(payload), flush=True)
        if args.output:
            Path(args.output).write_text(json.dumps(payload, indent=1))
    return 0


LM_EVAL_FLAGS = ("lm_eval_include_path", "lm_eval_limit", "lm_eval_num_fewshot")
"""Options of the lm-eval path that mean nothing without --lm-eval-tasks (and have no default)."""


def check_lm_eval_args(args, world: int):
    """The lm-eval path's checks, before any model is built: one process, sane numbers, lm_eval
    installed, every task known. Returns lm_eval's TaskManager (None without --lm-eval-tasks)."""
    if args.lm_eval_tasks is None:
        given = [name for name in LM_EVAL_FLAGS if getattr(args, name) is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --lm-eval-tasks")
        return None
    if world > 1:
        raise ConfigError(f"--lm-eval-tasks runs in one process; start epas-eval without torchrun (WORLD_SIZE is {world})")
    for flag, size in (("--tp", args.tp), ("--pp", args.pp)):
        if size != 1:
            raise ConfigError(f"{flag} {size}: --lm-eval-tasks runs with TP = PP = 1 (one process)")
    for flag, value, least in (("--lm-eval-limit", args.lm_eval_limit, 1), ("--lm-eval-batch-size", args.lm_eval_batch_size, 1),
                               ("--lm-eval-num-fewshot", args.lm_eval_num_fewshot, 0)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} {value}: must be >= {least}")
    if args.lm_eval_include_path is not None and not Path(args.lm_eval_include_path).is_dir():
        raise ConfigError(f"--lm-eval-include-path {args.lm_eval_include_path}: not a directory")
    args.lm_eval_task_list = [name.strip() for name in args.lm_eval_tasks.split(",") if name.strip()]
    if not args.lm_eval_task_list:
        raise ConfigError("--lm-eval-tasks: no task named")
    try:
        import lm_eval  # noqa: F401  (optional dependency)
    except ImportError:
        raise ConfigError("--lm-eval-tasks needs the lm-eval package: pip install lm-eval "
                          "(or pip install 'epas-megatron[eval]')") from None
    from epas_megatron.evaluation.lm_eval_model import task_manager_for

    return task_manager_for(args.lm_eval_task_list, args.lm_eval_include_path)


def lm_eval_main(args, task_manager) -> int:
    """--lm-eval-tasks: the harness at every region; one table, an ``LM_EVAL {json}`` line."""
    from epas_megatron.evaluation.lm_eval_model import markdown_table as lm_eval_table
    from epas_megatron.evaluation.lm_eval_model import run_lm_eval

    try:
        payload = run_lm_eval(args.load, args.region_list, args.lm_eval_task_list, include_path=args.lm_eval_include_path,
                              limit=args.lm_eval_limit, batch_size=args.lm_eval_batch_size,
                              num_fewshot=args.lm_eval_num_fewshot, allow_untrained=args.allow_untrained_regions,
                              precision=args.precision, task_manager=task_manager)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    print(f"checkpoint {payload['checkpoint']} (iteration {payload['iteration']}, trained region {payload['trained_region']} layers)")
    print(lm_eval_table(payload))
    print("LM_EVAL " + json.dumps(payload), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
