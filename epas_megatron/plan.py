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
(new weights, gradient buffer and optimizer state; no activations then). With ``--pp`` > 1 it
compares the pipeline schedules the run could use (1f1b; interleaved with ``--vpp``; v-1f1b,
v-half, v-min -- Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024):
every rank's memory at both regions under each (a V schedule's peak along each rank's action
list, a pass weighed by what it holds before and after its input-gradient backward), the
iteration time and bubble of the action lists simulated with F / B / W costs from the model
FLOPs (no p2p time), and names the fastest that fits the budget. The
figures are the model's (local layers; no CUDA context, workspaces or allocator fragmentation,
which the budget's 10% reserve stands for). Exit 0 when every rank fits, 3 when one does not,
2 on bad input. The launcher's ``DRY_RUN=1`` prints it too.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from epas_megatron.errors import ConfigError
from epas_megatron.metrics.flops import Convention, layer_matmul_flops, lm_head_forward_flops
from epas_megatron.metrics.rank_memory import rank_memory_bytes
from epas_megatron.model.architecture import ModelShape
from epas_megatron.model.v_placement import even_v_stage_sizes, v_stage
from epas_megatron.parallel.pipeline_schedule import PIPELINE_SCHEDULES, ScheduleFacts, build_schedule, megatron_schedule, paper_peak
from epas_megatron.parallel.schedule_simulation import PassCosts, simulate

DOES_NOT_FIT = 3
RESERVE = 0.9
"""Share of the GPU's memory the default budget allows."""


def _split_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="epas-plan", description=__doc__.split("\n\n")[0], add_help=True)
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes of the run (default: $WORLD_SIZE, else --tp x --pp: one data-parallel replica)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="memory per GPU in GiB (e.g. 80); the budget is 90%% of it unless --epas-memory-budget-gb says")
    return parser.parse_known_args(argv)


def report(run, gpu_memory_gb: Optional[float]) -> tuple[list[str], bool]:
    """The report's lines and whether every rank fits (always True without a budget)."""
    from epas_megatron.assembly import memory_settings, plan_after_switch, plan_for_run, stage_memory_limit
    from epas_megatron.metrics.flops import flops_per_iteration
    from epas_megatron.model.fusions import ASSUMED_GPU, KernelAvailability
    from epas_megatron.model.stage_layout import StageLayout
    from epas_megatron.parallel.memory_budget import GIB
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
    flops = {size: flops_per_iteration(ModelShape(first.arch, t.seq_length), t.global_batch_size, size,
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
    from epas_megatron.parallel.memory_budget import MemoryLimit

    measure = limit or MemoryLimit(ModelShape(first.arch, t.seq_length, t.micro_batch_size),
                                   memory_settings(run, kernels), p.pp, run.vpp or 1, float("inf"))
    measure = replace(measure, settings=replace(measure.settings, pipeline_schedule=run.pipeline_schedule.name))
    regions = (("first region (0 layers sharing)", ()), (f"final region ({len(final)} layers sharing)", final))
    own_rows, own_sizes = [], []  # per region: every rank's memory under the run's own schedule, its stage sizes
    for label, sharing in regions:
        modes = RegionShape.of(schedule).modes(sharing)
        if run.pipeline_schedule.v_placement:
            sizes = region_plan(sharing).v_stage_sizes if run.rebalance else first.v_stage_sizes
            sizes = sizes or even_v_stage_sizes(n, p.pp)
            per_rank = _v_rank_bytes(run, first, measure, modes, run.pipeline_schedule.name, sizes)
            where = f"{run.pipeline_schedule}, V placement ({', '.join(map(str, sizes))})"
        else:
            layout = region_plan(sharing).layout or StageLayout.even(n, p.pp, run.vpp or 1)
            per_rank, where, sizes = measure.layout_bytes(layout, modes), f"layout {layout.to_layout_string()}", layout.stage_sizes
        own_rows.append(per_rank)
        own_sizes.append(tuple(sizes))
        lines.append(f"memory per GPU at the {label}, {where}"
                     + (f" (budget {budget / GIB:.1f} GiB)" if budget else "") + ":")
        lines.append("  pp rank  parameters+grads+Adam  activations (in flight)       total")
        for rank, need in enumerate(per_rank):
            over = budget is not None and need["total"] > budget
            fits = fits and not over
            lines.append(f"  {rank:7d}  {need['parameters'] / GIB:17.2f} GiB  {need['activations'] / GIB:8.2f} GiB "
                         f"({need['in_flight']:.3g})  {need['total'] / GIB:8.2f} GiB{'  DOES NOT FIT' if over else ''}")
    switch_fits = True
    if schedule.num_switches and cfg.epas.epas_switch_mode == "memory":
        switch_lines, switch_fits = _switch_peaks(run, base, limit, measure, budget)
        lines += switch_lines
    choice = None
    if p.pp > 1:
        compare_lines, choice = _compare_schedules(run, first, measure, budget, own_rows, own_sizes[0], [sharing for _, sharing in regions])
        lines += compare_lines
    if fits and switch_fits:
        lines.append("fits")
    elif fits:
        lines.append("does NOT fit through an in-memory switch: raise --pp or --tp, use --use-distributed-optimizer, or switch "
                     "through a checkpoint (--epas-switch-mode checkpoint)")
    else:
        lines.append("does NOT fit: raise --pp or --tp, use --recompute selective or --use-distributed-optimizer, "
                     "or lower --micro-batch-size" + (f"; or --pipeline-schedule {choice}, which fits (compared above)"
                                                      if choice is not None and choice != run.pipeline_schedule.name else ""))
    fits = fits and switch_fits
    return lines, fits


def _v_rank_bytes(run, plan, measure, modes, name: str, sizes=None) -> list[dict]:
    """Every rank's memory under the V schedule ``name``: its two chunks' layers (V stages of
    ``sizes``, default the even split), the embedding and the LM head both on rank 0, and the
    schedule's peak along the rank's own list, each pass weighed by what it holds before and
    after its input-gradient backward
    (:func:`~epas_megatron.metrics.rank_memory.schedule_activation_peak`)."""
    pp = run.cfg.parallel.pp
    sizes = sizes or even_v_stage_sizes(plan.arch.num_layers, pp)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    settings = replace(measure.settings, pipeline_schedule=name)
    rows = []
    for rank in range(pp):
        stages = [v_stage(rank, chunk, pp) for chunk in (0, 1)]
        roles = [["share" if modes[i] == "share" else "compute" for i in range(starts[s], starts[s] + sizes[s])] for s in stages]
        rows.append(rank_memory_bytes(measure.shape, roles, rank, pp, 2, settings))
    return rows


SAME_TIME = 1.01
"""A schedule must be more than 1% faster (modelled) than the run's own to be chosen over it."""

"""How the paper counts each schedule's peak (Qi et al., NeurIPS 2024), in micro-batches of a rank."""


def layer_and_head_costs(arch, seq_length: int, micro_batch_size: int):
    """Modelled ``F`` / ``B`` / ``W`` (:class:`~epas_megatron.parallel.pipeline_schedule.PassCosts`,
    in FLOPs) of one micro-batch through one computing decoder layer and through the LM head: a
    GEMM's input gradient and its weight gradient each cost its forward; the attention core's
    backward twice its forward, all in ``B``."""
    shape = ModelShape(arch, seq_length)
    matmuls = layer_matmul_flops(shape, Convention.MEGATRON)
    core = matmuls.attention_scores + matmuls.attention_values
    gemms = matmuls.total - core
    b = micro_batch_size
    head = lm_head_forward_flops(shape) * b
    return PassCosts(forward=(gemms + core) * b, input_grad=(gemms + 2 * core) * b, weight_grad=gemms * b), \
        PassCosts(forward=head, input_grad=head, weight_grad=head)


def pass_costs(arch, seq_length: int, micro_batch_size: int, pp: int):
    """:func:`layer_and_head_costs` of the whole model over ``pp`` ranks: one micro-batch through
    an average rank's share."""
    layer, head = layer_and_head_costs(arch, seq_length, micro_batch_size)
    n = arch.num_layers
    return PassCosts(forward=(n * layer.forward + head.forward) / pp, input_grad=(n * layer.input_grad + head.input_grad) / pp,
                     weight_grad=(n * layer.weight_grad + head.weight_grad) / pp)


def stage_costs(layer, head, stage_sizes: Sequence[int]) -> dict:
    """Each virtual stage's costs: its layers', the LM head's on the last stage."""
    last = len(stage_sizes) - 1
    return {s: PassCosts(forward=k * layer.forward + (s == last) * head.forward,
                         input_grad=k * layer.input_grad + (s == last) * head.input_grad,
                         weight_grad=k * layer.weight_grad + (s == last) * head.weight_grad)
            for s, k in enumerate(stage_sizes)}


def schedule_time(name: str, pp: int, num_microbatches: int, costs: dict, vpp: Optional[int] = None) -> tuple[float, float]:
    """(iteration time, bubble) of schedule ``name`` with per-virtual-stage ``costs`` (stage
    ``k`` of the interleaved schedule: chunk ``k // pp`` of rank ``k % pp``), no p2p time: the
    action lists simulated (:func:`~epas_megatron.parallel.schedule_simulation.simulate`);
    Megatron's interleaved schedule (no lists here) by its steady state and bubble at the
    slowest rank's pace, ``m T + (p - 1) T / vpp`` with ``T`` that rank's ``F + B + W``."""
    if PIPELINE_SCHEDULES[name].placement == "interleaved":
        slowest = max(sum(costs[k].of("F") + costs[k].of("BW") for k in range(rank, pp * vpp, pp)) for rank in range(pp))
        span = num_microbatches * slowest + (pp - 1) * slowest / vpp
        return span, 1 - num_microbatches * slowest / span
    sim = simulate(build_schedule(name, pp, num_microbatches), stage_costs=costs)
    return sim.makespan, sim.bubble


def _applicable_schedules(run) -> tuple[list[str], list[str]]:
    """(the schedules this run could use, notes on those it cannot: each one's first refusal for
    this run's facts, as the run's validation would raise it -- the run's ``--vpp`` for the
    interleaved schedule, none for the others: 1F1B is the baseline, V placement places two
    chunks itself)."""
    cfg, names, notes = run.cfg, [], []
    for name, kind in PIPELINE_SCHEDULES.items():
        facts = ScheduleFacts(pp=cfg.parallel.pp, microbatches=run.num_microbatches,
                              vpp=run.vpp if kind.placement == "interleaved" else None, num_layers=cfg.model.num_layers,
                              tied_embeddings=not cfg.model.untie_embeddings_and_output_weights,
                              overlap_grad_reduce=cfg.parallel.overlap_grad_reduce, backend=run.backend)
        refusals = kind.refusals(facts)
        if not refusals:
            names.append(name)
        elif kind.v_placement:  # (Megatron's two: the run's --vpp picks one, the other is no option)
            notes.append(f"{name}: not applicable ({refusals[0]})")
    return names, notes


@dataclass
class ScheduleOption:
    """One pipeline schedule as the report compares it."""

    name: str

    rows: list
    """Per region compared (first, final): every rank's :func:`~epas_megatron.metrics.rank_memory.rank_memory_bytes`."""

    time: float
    """Modelled iteration time, FLOPs along the slowest path (:func:`schedule_time`)."""

    bubble: float

    fits: bool
    """Every rank of every region within the budget (True without one)."""

    worst_rank: int
    """The rank with the most memory."""


def choose_schedule(options: Sequence[ScheduleOption], own: str) -> Optional[str]:
    """The fastest option that fits; the run's ``own`` schedule instead when it fits and the
    fastest is not more than 1% faster (:data:`SAME_TIME`: the p2p time, twice 1F1B's under V
    placement, is not modelled); None when none fits."""
    fitting = [option for option in options if option.fits]
    if not fitting:
        return None
    fastest = min(fitting, key=lambda option: option.time)
    mine = next((option for option in fitting if option.name == own), None)
    return own if mine is not None and mine.time <= SAME_TIME * fastest.time else fastest.name


def schedule_options(run, plan, measure, budget: Optional[float], own_rows, own_sizes, regions
                     ) -> tuple[list[ScheduleOption], list[str]]:
    """Every applicable pipeline schedule (:func:`_applicable_schedules`) priced: each rank's
    memory at ``regions`` (the run's own schedule: ``own_rows``, with its planned layouts; 1F1B
    and interleaved on the even layout; V schedules on the even V split), the iteration time and
    bubble at the first region (:func:`schedule_time`; the run's own on its first region's
    ``own_sizes``, per virtual stage, the others on the even ones), and whether every rank fits
    ``budget``; and notes on the schedules left out."""
    from epas_megatron.model.stage_layout import StageLayout
    from epas_megatron.sharing.shape import RegionShape

    pp, n, m = run.cfg.parallel.pp, run.cfg.model.num_layers, run.num_microbatches
    names, notes = _applicable_schedules(run)
    layer, head = layer_and_head_costs(plan.arch, run.cfg.training.seq_length, run.cfg.training.micro_batch_size)
    options = []
    for name in names:
        if name == run.pipeline_schedule.name:
            rows, sizes = own_rows, own_sizes
        else:
            kind = PIPELINE_SCHEDULES[name]
            chunks = kind.chunks_per_rank(run.vpp) or 1
            sizes = even_v_stage_sizes(n, pp) if kind.v_placement else StageLayout.even(n, pp, chunks).stage_sizes
            rows = []
            for sharing in regions:
                modes = RegionShape.of(run.schedule).modes(sharing)
                if kind.v_placement:
                    rows.append(_v_rank_bytes(run, plan, measure, modes, name))
                else:
                    limit = replace(measure, vpp=chunks, settings=replace(measure.settings, pipeline_schedule=name))
                    rows.append(limit.layout_bytes(StageLayout.even(n, pp, chunks), modes))
        worst, worst_rank = max((need["total"], rank) for per_rank in rows for rank, need in enumerate(per_rank))
        time, bubble = schedule_time(name, pp, m, stage_costs(layer, head, sizes), run.vpp)
        options.append(ScheduleOption(name, rows, time, bubble, budget is None or worst <= budget, worst_rank))
    return options, notes


def _compare_schedules(run, plan, measure, budget: Optional[float], own_rows, own_sizes, regions) -> tuple[list[str], Optional[str]]:
    """The report's lines comparing the schedules (:func:`schedule_options`) and the choice
    (:func:`choose_schedule`)."""
    from epas_megatron.parallel.memory_budget import GIB

    pp = run.cfg.parallel.pp
    options, notes = schedule_options(run, plan, measure, budget, own_rows, own_sizes, regions)
    costs = pass_costs(plan.arch, run.cfg.training.seq_length, run.cfg.training.micro_batch_size, pp)
    base = next(option.time for option in options if option.name == megatron_schedule().name)
    largest = max(need["total"] for option in options for per_rank in option.rows for need in per_rank)
    unit, size = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    lines = [f"pipeline schedules compared (PP {pp}, {run.num_microbatches} micro-batches; F : B : W = 1 : "
             f"{costs.input_grad / costs.forward:.2f} : {costs.weight_grad / costs.forward:.2f} from the model FLOPs, each stage's "
             f"own, no p2p time; time relative to 1f1b; memory per pp rank in {unit} at the first | final region"
             + (f"; budget {budget / size:.1f} {unit}" if budget else "") + "):",
             f"  schedule     in flight (paper)       time    bubble  memory per pp rank, {unit}"]
    for option in options:
        in_flight = max(need["in_flight"] for per_rank in option.rows for need in per_rank)
        kind = PIPELINE_SCHEDULES[option.name]
        paper = "--" if kind.placement == "interleaved" else f"{paper_peak(option.name, pp):g} = {kind.paper_units}"
        memory = " | ".join(" ".join(f"{need['total'] / size:.1f}" for need in per_rank) for per_rank in option.rows)
        verdict = "" if budget is None else "fits" if option.fits else f"DOES NOT FIT (rank {option.worst_rank})"
        lines.append(f"  {option.name:11s}  {in_flight:5.2f} ({paper:14s})  {option.time / base:5.3f}  {100 * option.bubble:5.1f}%  "
                     f"{memory}  {verdict}".rstrip())
    lines += [f"  {note}" for note in notes]
    choice = choose_schedule(options, run.pipeline_schedule.name)
    if choice is None:
        lines.append("schedule choice: none of them fits the budget")
    else:
        lines.append(f"schedule choice: {choice}, the fastest " + ("that fits the budget" if budget is not None else "(no budget given)")
                     + (" -- the run's own (another must be more than 1% faster)" if choice == run.pipeline_schedule.name else
                        f" (this run: --pipeline-schedule {run.pipeline_schedule})"))
    return lines, choice


def _switch_peaks(run, base, limit, measure, budget: Optional[float]) -> tuple[list[str], bool]:
    """Each pipeline rank's largest in-memory switch (:meth:`~epas_megatron.parallel.memory_budget.MemoryLimit.switch_bytes`
    between the layouts planned for the regions before and after it): the report's lines and
    whether every rank fits ``budget``."""
    from epas_megatron.assembly import plan_after_switch
    from epas_megatron.model.stage_layout import StageLayout, VStageLayout
    from epas_megatron.parallel.memory_budget import GIB
    from epas_megatron.sharing.shape import RegionShape

    schedule, p = run.schedule, run.cfg.parallel
    region = RegionShape.of(schedule)
    layouts: dict = {}
    if run.pipeline_schedule.v_placement:  # two chunks per rank in V order, both ends on rank 0
        measure = replace(measure, vpp=2)

    def layout_of(sharing):
        if sharing not in layouts:  # (the budget's notices are printed with the first and final regions)
            planned = plan_after_switch(run, base, sharing, memory=limit)[0]
            if run.pipeline_schedule.v_placement:
                sizes = planned.v_stage_sizes or even_v_stage_sizes(run.cfg.model.num_layers, p.pp)
                layouts[sharing] = VStageLayout(tuple(sizes), p.pp)
            else:
                layouts[sharing] = planned.layout or StageLayout.even(run.cfg.model.num_layers, p.pp, run.vpp or 1)
        return layouts[sharing]

    worst: list = [None] * p.pp
    for iteration, _ in schedule.switch_iterations():
        before, after = schedule.sharing_layers(iteration - 1), schedule.sharing_layers(iteration)
        per_rank = measure.switch_bytes(layout_of(before), region.modes(before), layout_of(after), region.modes(after))
        for rank, need in enumerate(per_rank):
            if worst[rank] is None or need["peak"] > worst[rank][0]["peak"]:
                worst[rank] = (need, iteration)
    lines = ["memory per GPU through its largest in-memory switch (--epas-switch-mode memory: the new objects are "
             "built on the meta device and take the state over, the optimizer state moves kind by kind through the "
             "gradient buffer; no micro-batch in flight; step peak: the larger of the steps before and after it)"
             + (f" (budget {budget / GIB:.1f} GiB)" if budget else "") + ":",
             "  pp rank  state before  switch transient   switch peak    step peak"]
    fits, above_step = True, []
    for rank, (need, iteration) in enumerate(worst):
        over = budget is not None and need["peak"] > budget
        fits = fits and not over
        if need["peak"] > need["step_peak"]:
            above_step.append(rank)
        lines.append(f"  {rank:7d}  {need['parameters'] / GIB:8.2f} GiB  {need['transient'] / GIB:12.2f} GiB  "
                     f"{need['peak'] / GIB:8.2f} GiB  {need['step_peak'] / GIB:8.2f} GiB  (switch at iteration {iteration})"
                     f"{'  DOES NOT FIT' if over else ''}")
    lines.append("every switch peaks below the steps around it: it fits wherever the steps fit" if not above_step else
                 f"the switch peaks above the steps around it on pp rank(s) {', '.join(map(str, above_step))}")
    return lines, fits


def main(argv: Optional[Sequence[str]] = None) -> int:
    from epas_megatron.compat.quiet import quiet_library_noise

    quiet_library_noise()
    from epas_megatron.config.cli import parse_config
    from epas_megatron.training.registry import features_for_run
    from epas_megatron.validation import resolve_run

    ours, rest = _split_argv(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_config(rest)
        world = ours.world_size
        if world is None:  # a planner runs no processes: the world is the one it plans for
            world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else cfg.parallel.tp * cfg.parallel.pp
        if world < 1:
            raise ConfigError(f"--world-size must be >= 1, got {world}")
        if world % (cfg.parallel.tp * cfg.parallel.pp):
            raise ConfigError(f"--world-size {world} is not a multiple of --tp {cfg.parallel.tp} x --pp {cfg.parallel.pp}: "
                              "set --world-size to the processes the run will have")
        if ours.gpu_memory_gb is not None and not ours.gpu_memory_gb > 0:
            raise ConfigError(f"--gpu-memory-gb must be > 0, got {ours.gpu_memory_gb}")
        run = resolve_run(cfg, world_size=world, cuda=ours.gpu_memory_gb is not None or None, planning_only=True)
        features_for_run(run)  # the training features' own refusals, as epas-train makes them
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
