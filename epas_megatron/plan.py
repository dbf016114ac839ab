"""``epas-plan``: will this run fit? -- before anything starts.

    epas-plan --world-size 8 --gpu-memory-gb 80 --config launch/configs/7b.yaml
    epas-plan --world-size 2 --preset tiny --pp 2 --epas-target-layers 2      (any epas-train flags)

Takes the training flags (or ``--config``) of ``epas-train`` plus the world it will run on, and
prints -- without starting processes or touching data beyond the tokenizer's size -- the
parallel shape, the model FLOPs of an iteration at the first and the final sharing region, the
pipeline layout planned for every switch (within the memory budget), and every pipeline rank's
memory at the first and the final region from :mod:`epas_megatron.metrics.memory_model`:
weights + gradients + Adam state, and the activations of its in-flight micro-batches; with
in-memory switches (``--epas-switch-mode memory``, the default) also each rank's peak through
its worst switch: the parameter state plus what the switch allocates before the old state goes
(new weights, gradient buffer and optimizer state; no activations then). The
figures are the model's (local layers; no CUDA context, workspaces or allocator fragmentation,
which the budget's 10% reserve stands for). Exit 0 when every rank fits, 3 when one does not,
2 on bad input. The launcher's ``DRY_RUN=1`` prints it too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from epas_megatron.errors import ConfigError

DOES_NOT_FIT = 3
RESERVE = 0.9
"""Share of the GPU's memory the default budget allows."""


def _split_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="epas-plan", description=__doc__.split("\n\n")[0], add_help=True)
    parser.add_argument("--world-size", type=int, default=None, help="processes of the run (default: $WORLD_SIZE, else 1)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="memory per GPU in GiB (e.g. 80); the budget is 90%% of it unless --epas-memory-budget-gb says")
    return parser.parse_known_args(argv)


def report(run, gpu_memory_gb: Optional[float]) -> tuple[list[str], bool]:
    """The report's lines and whether every rank fits (always True without a budget)."""
    from epas_megatron.assembly import memory_settings, plan_after_switch, plan_for_run, stage_memory_limit
    from epas_megatron.metrics.flops import Convention, ModelShape, flops_per_iteration
    from epas_megatron.model.fusions import ASSUMED_GPU, KernelAvailability
    from epas_megatron.parallel.layout import StageLayout
    from epas_megatron.parallel.memory_budget import GIB
    from epas_megatron.parallel.pipeline_schedule import V_SCHEDULES
    from epas_megatron.runtime.device import device_memory_gb
    from epas_megatron.sharing.shape import RegionShape

    cfg = run.cfg
    if cfg.epas.epas_memory_budget_gb is None and gpu_memory_gb is not None:
        cfg.epas.epas_memory_budget_gb = RESERVE * gpu_memory_gb
    schedule, n = run.schedule, cfg.model.num_layers
    final = tuple(schedule.sharing_layers(cfg.training.train_iters))
    base = plan_for_run(run, ())
    # The kernels of the node the run is for: a GPU's defaults when planned for one from here.
    kernels = ASSUMED_GPU if gpu_memory_gb is not None else KernelAvailability.detect()
    limit = stage_memory_limit(run, base, device_memory_gb(), kernels)

    def region_plan(sharing):
        """The plan the trainer would build for ``sharing`` (its layout rebalanced when stages are)."""
        plan, notice = plan_after_switch(run, base, sharing, memory=limit)
        if notice:
            print(f"memory budget: {notice}", flush=True)
        return plan

    first = region_plan(()) if run.rebalance else base
    t, p = cfg.training, cfg.parallel
    m = cfg.model
    lines = [f"epas-plan: {m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}/{m.num_query_groups}, "
             f"ffn {m.ffn_hidden_size}, vocab {first.arch.vocab_size}, seq {t.seq_length} | world {run.world_size} = TP {p.tp} "
             f"x PP {p.pp}{f' (VPP {run.vpp})' if run.vpp else ''} x DP {run.dp} | global batch {t.global_batch_size} = "
             f"{run.num_microbatches} micro-batches x {t.micro_batch_size} x DP {run.dp} | {run.precision}"
             f"{', distributed optimizer' if run.use_distributed_optimizer else ''}"
             f"{', recompute ' + p.recompute if p.recompute != 'none' else ''}"]
    flops = {size: flops_per_iteration(ModelShape.of(first.arch, t.seq_length), t.global_batch_size, size,
                                       share=cfg.epas.epas_share, convention=Convention.MEGATRON) for size in (0, len(final))}
    lines.append(f"model FLOPs per iteration: {flops[0] / 1e15:.3f} PFLOP at region 0, {flops[len(final)] / 1e15:.3f} PFLOP at the "
                 f"final region ({len(final)} layers; {flops[0] / flops[len(final)]:.4f}x fewer)")
    if run.schedule.enabled:
        lines.append(run.schedule.describe(t.train_iters))
    if run.rebalance:
        from epas_megatron.parallel.stage_layouts import describe_schedule_layouts

        lines.append("pipeline stages, rebalanced at every switch:")
        lines.append(describe_schedule_layouts(first, schedule, memory=limit))
    fits = True
    budget = limit.budget_bytes if limit is not None else None
    from epas_megatron.metrics.memory_model import LayerShape
    from epas_megatron.parallel.memory_budget import MemoryLimit

    measure = limit or MemoryLimit(LayerShape(first.arch.hidden_size, first.arch.num_attention_heads,
                                              first.arch.num_query_groups, first.arch.ffn_hidden_size,
                                              t.seq_length, t.micro_batch_size),
                                   memory_settings(run, first.arch.vocab_size, kernels), p.pp, run.vpp or 1, float("inf"))
    for label, sharing in (("first region (0 layers sharing)", ()), (f"final region ({len(final)} layers sharing)", final)):
        modes = RegionShape.of(schedule).modes(sharing)
        if run.pipeline_schedule in V_SCHEDULES:
            per_rank, where = _v_rank_bytes(run, first, measure, modes), f"{run.pipeline_schedule}, V placement"
        else:
            layout = region_plan(sharing).layout or StageLayout.even(n, p.pp, run.vpp or 1)
            per_rank, where = measure.layout_bytes(layout, modes), f"layout {layout.to_layout_string()}"
        lines.append(f"memory per GPU at the {label}, {where}"
                     + (f" (budget {budget / GIB:.1f} GiB)" if budget else "") + ":")
        lines.append("  pp rank  parameters+grads+Adam  activations (in flight)       total")
        for rank, need in enumerate(per_rank):
            over = budget is not None and need["total"] > budget
            fits = fits and not over
            lines.append(f"  {rank:7d}  {need['parameters'] / GIB:17.2f} GiB  {need['activations'] / GIB:8.2f} GiB ({need['in_flight']:g})"
                         f"  {need['total'] / GIB:8.2f} GiB{'  DOES NOT FIT' if over else ''}")
    switch_fits = True
    if schedule.num_switches and cfg.epas.epas_switch_mode == "memory" and run.pipeline_schedule in V_SCHEDULES:
        lines.append("memory through an in-memory switch: not modelled yet under V placement (the region's figures above are)")
    elif schedule.num_switches and cfg.epas.epas_switch_mode == "memory":
        switch_lines, switch_fits = _switch_peaks(run, base, limit, measure, budget)
        lines += switch_lines
    if fits and switch_fits:
        lines.append("fits")
    elif fits:
        lines.append("does NOT fit through an in-memory switch: raise --pp or --tp, use --use-distributed-optimizer, or switch "
                     "through a checkpoint (--epas-switch-mode checkpoint)")
    else:
        lines.append("does NOT fit: raise --pp or --tp, use --recompute selective or --use-distributed-optimizer, "
                     "or lower --micro-batch-size")
    fits = fits and switch_fits
    return lines, fits


def _v_rank_bytes(run, plan, measure, modes) -> list[dict]:
    """Every rank's memory under V placement: its two chunks' layers (the V stages of the even
    split), the embedding and the LM head both on rank 0, and the schedule's own peak of
    in-flight micro-batches from its simulation."""
    from epas_megatron.metrics.memory_model import rank_memory_bytes
    from epas_megatron.model.v_placement import even_v_stage_sizes, v_stage
    from epas_megatron.parallel.pipeline_schedule import build_schedule, simulate

    pp = run.cfg.parallel.pp
    sizes = even_v_stage_sizes(plan.arch.num_layers, pp)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    peaks = simulate(build_schedule(run.pipeline_schedule, pp, run.num_microbatches)).peak_in_flight
    rows = []
    for rank in range(pp):
        stages = [v_stage(rank, chunk, pp) for chunk in (0, 1)]
        roles = [["share" if modes[i] == "share" else "compute" for i in range(starts[s], starts[s] + sizes[s])] for s in stages]
        rows.append(rank_memory_bytes(measure.shape, roles, rank, pp, 2, measure.settings, in_flight=peaks[rank], head_rank=0))
    return rows


def _switch_peaks(run, base, limit, measure, budget: Optional[float]) -> tuple[list[str], bool]:
    """Each pipeline rank's largest in-memory switch (:meth:`~epas_megatron.parallel.memory_budget.MemoryLimit.switch_bytes`
    between the layouts planned for the regions before and after it): the report's lines and
    whether every rank fits ``budget``."""
    from epas_megatron.assembly import plan_after_switch
    from epas_megatron.parallel.layout import StageLayout
    from epas_megatron.parallel.memory_budget import GIB
    from epas_megatron.sharing.shape import RegionShape

    schedule, p = run.schedule, run.cfg.parallel
    region = RegionShape.of(schedule)
    layouts: dict = {}

    def layout_of(sharing):
        if sharing not in layouts:  # (the budget's notices are printed with the first and final regions)
            planned = plan_after_switch(run, base, sharing, memory=limit)[0].layout
            layouts[sharing] = planned or StageLayout.even(run.cfg.model.num_layers, p.pp, run.vpp or 1)
        return layouts[sharing]

    worst: list = [None] * p.pp
    for iteration, _ in schedule.switch_iterations():
        before, after = schedule.sharing_layers(iteration - 1), schedule.sharing_layers(iteration)
        per_rank = measure.switch_bytes(layout_of(before), region.modes(before), layout_of(after), region.modes(after))
        for rank, need in enumerate(per_rank):
            if worst[rank] is None or need["peak"] > worst[rank][0]["peak"]:
                worst[rank] = (need, iteration)
    lines = ["memory per GPU through its largest in-memory switch (--epas-switch-mode memory: the new model, gradient "
             "buffer and optimizer state exist before the old go; no micro-batch in flight)"
             + (f" (budget {budget / GIB:.1f} GiB)" if budget else "") + ":",
             "  pp rank  state before  switch transient        peak"]
    fits = True
    for rank, (need, iteration) in enumerate(worst):
        over = budget is not None and need["peak"] > budget
        fits = fits and not over
        lines.append(f"  {rank:7d}  {need['parameters'] / GIB:8.2f} GiB  {need['transient'] / GIB:12.2f} GiB  "
                     f"{need['peak'] / GIB:8.2f} GiB  (switch at iteration {iteration}){'  DOES NOT FIT' if over else ''}")
    return lines, fits


def main(argv: Optional[Sequence[str]] = None) -> int:
    from epas_megatron.compat.quiet import quiet_library_noise

    quiet_library_noise()
    from epas_megatron.config.cli import parse_config
    from epas_megatron.config.validation import resolve_run
    from epas_megatron.runtime.distributed import world_size_from_env

    ours, rest = _split_argv(sys.argv[1:] if argv is None else argv)
    try:
        world = world_size_from_env() if ours.world_size is None else ours.world_size
        if world < 1:
            raise ConfigError(f"--world-size must be >= 1, got {world}")
        if ours.gpu_memory_gb is not None and not ours.gpu_memory_gb > 0:
            raise ConfigError(f"--gpu-memory-gb must be > 0, got {ours.gpu_memory_gb}")
        run = resolve_run(parse_config(rest), world_size=world, cuda=ours.gpu_memory_gb is not None or None, planning_only=True)
        if run.cfg.parallel.recompute == "full":
            print("note: --recompute full is not in the memory model; activations are shown as without recompute", flush=True)
        lines, fits = report(run, ours.gpu_memory_gb)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    print("\n".join(lines), flush=True)
    return 0 if fits else DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())
