"""``epas-bench pipeline --schedule ...``: pipeline schedules with controllable memory (Qi et al.,
"Pipeline Parallelism with Controllable Memory", NeurIPS 2024) measured against 1F1B.

Run under torchrun with one pipeline rank per process (``p`` = the number of processes; CPU:
``torchrun --nproc-per-node 4``). Every schedule listed (``1f1b``, ``v-1f1b``, ``v-half``,
``v-min``) gets its own copy of the same model -- same seed, hence the same weights, the same
``--region`` sharing, the same synthetic tokens -- in one process group, placed as the schedule
wants (1F1B: ``L/p`` layers per rank; V: two chunks per rank, embedding and loss on rank 0), and
trained by the project's executor (:mod:`epas_megatron.engine.pipeline_executor`; its ``1f1b``
lists are Megatron-Core's 1F1B bit for bit). Per schedule:

* **peak memory per rank**, measured on one untimed iteration after the warm-up: on a GPU
  ``torch.cuda.max_memory_allocated`` above what was allocated when the iteration began; on the
  CPU the same count from torch's CPU allocator, read from the profiler's memory events
  (``profile_memory=True``): the most bytes allocated during the iteration and still live at one
  moment. The profiler cannot see a block allocated before it started being freed, so on the CPU
  this is an upper bound of the allocator's peak above the start (equal when no older block is
  freed before the peak). It covers the whole training step (forward, backward, optimizer);
  the weights, gradient buffers and Adam state held before it are not counted;
* **seconds per iteration**: the median over ``--iters`` timed iterations, the schedules taking
  turns (A B C, C B A, ...) so drift on a shared machine hits them alike;
* **bubble, executed**: from the executor's recorded timeline of each timed iteration, the idle
  share ``1 - busy / span`` of the rank with the longest span
  (:func:`~epas_megatron.engine.pipeline_executor.executed_bubble`, as
  :attr:`~epas_megatron.parallel.schedule_simulation.Simulation.bubble` defines it), median over
  iterations; next to it the **simulated** bubble of the same lists: replayed with this run's
  mean time of each pass on each stage (:func:`replay`: the simulation's rule with a cost per
  action -- stages differ, e.g. the LM head's), and :func:`~epas_megatron.parallel.schedule_simulation.simulate`'s
  with the paper's unit costs ``F = B = W`` (every rank alike);
* the **activations the memory model predicts** per rank for this model
  (:func:`~epas_megatron.metrics.rank_memory.rank_memory_bytes` with the simulation's in-flight
  peak per rank) -- the measured peak adds what the model leaves out: transients such as the
  logits' copies in the loss, p2p buffers, the optimizer step's temporaries;
* **p2p bytes** each rank sent per iteration (the recorder's count: messages x tensor bytes --
  V placement sends twice 1F1B's messages);
* the **loss** after the steps: every schedule runs the same number of steps on the same data, and
  the schedules differ only in the order of the same arithmetic, so the losses must agree (to
  fp32 rounding: gradients are accumulated in another order).

It then prints a **PREDICTED** table (a model, not a measurement) for 7B at ``p = 4`` and
``p = 8``: the bubble and iteration time from :func:`~epas_megatron.parallel.schedule_simulation.simulate`
with modelled pass costs and each rank's peak memory from the memory model. Pass costs: the
matmul FLOPs of a rank's decoder layers (:mod:`epas_megatron.metrics.flops`, causal halving as
flash kernels run): ``F`` = GEMMs + attention core, ``B`` = GEMMs (input gradients) + twice the
attention core (its backward has no weights), ``W`` = GEMMs (weight gradients) -- the paper's
``W ~ B`` for the GEMM share; a message costs its bytes at
:data:`~epas_megatron.parallel.cost_model.P2P_FLOPS_PER_BYTE`. Memory:
:func:`~epas_megatron.metrics.rank_memory.rank_memory_bytes` with the simulation's in-flight peak
per rank (bf16, GPU kernels, no sharing; the largest activations and the largest total over the
ranks). The LM head, the embedding and the optimizer step are left out of the time model (the
simulation prices every rank alike).

Last line: ``BENCH {json}``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from epas_megatron.errors import ConfigError
from epas_megatron.metrics.flops import Convention, layer_matmul_flops
from epas_megatron.metrics.rank_memory import RankMemorySettings, rank_memory_bytes
from epas_megatron.model.architecture import ModelShape, architecture_from_preset
from epas_megatron.model.v_placement import even_v_stage_sizes, v_stage
from epas_megatron.parallel.cost_model import P2P_FLOPS_PER_BYTE
from epas_megatron.parallel.pipeline_schedule import PIPELINE_SCHEDULES, Action, ScheduleActions, build_schedule
from epas_megatron.parallel.schedule_simulation import PassCosts, simulate

BENCH_SCHEDULES = tuple(name for name, kind in PIPELINE_SCHEDULES.items() if kind.placement != "interleaved")
"""What ``--schedule`` takes: the schedules the project's executor runs (``interleaved`` is
Megatron-Core's own loop, with no action lists to record)."""

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class ScheduleBenchConfig:
    """What ``epas-bench pipeline --schedule`` measures."""

    preset: str
    """Model preset."""

    schedules: tuple[str, ...]
    """Schedules to compare, in the order given."""

    region: int
    """Sharing layers (the deepest ones); 0: none."""

    iters: int
    """Timed iterations per schedule (the schedules take turns)."""

    warmup: int
    """Untimed iterations per schedule first (at least one: Adam's state must exist before the
    memory is measured)."""

    seq_length: int
    """Sequence length."""

    micro_batch_size: int
    """Sequences per micro-batch."""

    num_microbatches: int
    """Micro-batches per iteration (at least ``p``)."""

    share: str = "qk"
    """What sharing layers reuse ('qk' or 'kv')."""

    core_attention: str = "sdpa"
    """Attention kernel of local layers."""

    seed: int = 1234
    """Initialisation and data seed (every schedule's model gets the same weights and tokens)."""


def parse_schedules(names: Sequence[str]) -> tuple[str, ...]:
    """``--schedule`` values, deduplicated in order; a ConfigError naming the flag otherwise."""
    schedules = tuple(dict.fromkeys(name.strip() for name in names))
    for name in schedules:
        if name in PIPELINE_SCHEDULES and PIPELINE_SCHEDULES[name].placement == "interleaved":
            raise ConfigError("--schedule interleaved is Megatron-Core's own schedule: the executor has no action lists "
                              f"to record for it; choose from {', '.join(BENCH_SCHEDULES)}")
        if name not in BENCH_SCHEDULES:
            raise ConfigError(f"--schedule {name!r} is not a schedule; choose from {', '.join(BENCH_SCHEDULES)}")
    return schedules


def check_config(cfg: ScheduleBenchConfig, num_layers: int, world: int) -> None:
    """Everything the run needs, before any process group: a ConfigError naming the flag."""
    if world < 2:
        raise ConfigError(f"--schedule runs one pipeline rank per process: start it under torchrun with p >= 2 processes "
                          f"(torchrun --nproc-per-node 4 -m epas_megatron.bench.cli pipeline --schedule ...), got {world}")
    p = world
    for name in cfg.schedules:
        if PIPELINE_SCHEDULES[name].v_placement and num_layers < 2 * p:
            raise ConfigError(f"--schedule {name} places 2p = {2 * p} V stages over p = {p} ranks: the {cfg.preset} preset has "
                              f"{num_layers} layers (use a preset with at least {2 * p} layers, or fewer processes)")
        if PIPELINE_SCHEDULES[name].placement == "stages" and num_layers % p:
            raise ConfigError(f"--schedule 1f1b splits the {num_layers} layers of the {cfg.preset} preset evenly over p = {p} "
                              "ranks: use a process count that divides them")
    if cfg.num_microbatches < p:
        raise ConfigError(f"--num-microbatches {cfg.num_microbatches} is fewer than the p = {p} pipeline ranks: --schedule "
                          f"needs at least {p} micro-batches per iteration")
    if not 0 <= cfg.region < num_layers:
        raise ConfigError(f"--region must be between 0 (no sharing) and {num_layers - 1} for the {cfg.preset} preset")
    if cfg.iters < 1:
        raise ConfigError(f"--iters must be >= 1, got {cfg.iters}")
    if cfg.warmup < 1:
        raise ConfigError(f"--warmup must be >= 1 with --schedule (the measured iteration must not be the optimizer's "
                          f"first, whose new Adam state would count as the schedule's memory), got {cfg.warmup}")
    if cfg.seq_length < 1 or cfg.micro_batch_size < 1:
        raise ConfigError("--seq-length and --micro-batch-size must be >= 1")


# ---------------------------------------------------------------------------- measured
def _sync() -> None:
    """Queued GPU work done and every rank here (before and after a timed iteration)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def cpu_allocation_peak(prof) -> int:
    """The most bytes torch's CPU allocator held at one moment of a profiled window above what it
    held when the window began, from the profiler's memory events (``profile_memory=True``).
    Blocks allocated before the window are invisible to the profiler, their releases too."""
    from torch._C._profiler import _EventType

    events = []

    def walk(node):
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    allocated = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        allocated += size
        peak = max(peak, allocated)
    return peak


def measure_peak_bytes(step: Callable[[], object]) -> int:
    """Peak bytes allocated during ``step()`` above what was allocated when it began (see the
    module doc: the CUDA allocator's count on a GPU, the CPU allocator's through the profiler)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return cpu_allocation_peak(prof)


def pass_costs_of(timelines: Sequence, schedule: ScheduleActions) -> PassCosts:
    """:class:`PassCosts` from executed timelines: the mean seconds of each kind of pass, times
    the chunks per rank (the simulation prices a pass through a whole rank's layers)."""
    def mean(kind):
        values = [d for t in timelines for d in t.durations(kind)]
        return statistics.fmean(values) if values else 0.0

    c = schedule.chunks_per_rank
    if schedule.split_backward:
        return PassCosts(forward=c * mean("F"), input_grad=c * mean("B"), weight_grad=c * mean("W"))
    return PassCosts(forward=c * mean("F"), input_grad=c * mean("BW"), weight_grad=0.0)


def stage_pass_seconds(timelines: Sequence) -> dict[tuple[str, int], float]:
    """Mean seconds of each kind of pass on each stage, ``(kind, stage) -> seconds``, over the
    executed timelines given (every iteration and micro-batch)."""
    totals: dict[tuple[str, int], list[float]] = {}
    for t in timelines:
        for action, start, end in zip(t.actions, t.start, t.end):
            totals.setdefault((action.kind, action.stage), []).append(end - start)
    return {key: statistics.fmean(values) for key, values in totals.items()}


def replay(schedule: ScheduleActions, seconds: Callable[[Action], float]) -> tuple[float, list[float], list[float]]:
    """:func:`~epas_megatron.parallel.schedule_simulation.simulate` with a cost per action (no p2p
    time). Returns (bubble of the longest-span rank, busy and span per rank)."""
    sim = simulate(schedule, action_seconds=seconds)
    longest = max(range(schedule.pp), key=lambda r: sim.span[r])
    return 1.0 - sim.busy[longest] / sim.span[longest], sim.busy, sim.span


def modelled_activation_bytes(plan, schedule: ScheduleActions, settings: RankMemorySettings, shape: ModelShape) -> list[float]:
    """The memory model's activations per rank of ``plan`` under ``schedule`` (1F1B: Megatron's
    even split, the LM head on the last rank; V: the even V stages, both ends on rank 0), times the
    simulation's in-flight peak of each rank."""
    from epas_megatron.sharing.shape import LayerMode

    roles = ["share" if mode == LayerMode.SHARE else "compute" for mode in plan.modes]
    p, sim = schedule.pp, simulate(schedule)
    if schedule.v_placement:
        sizes = even_v_stage_sizes(len(roles), p)
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        chunks = [[roles[starts[v_stage(r, c, p)]:starts[v_stage(r, c, p)] + sizes[v_stage(r, c, p)]] for c in (0, 1)]
                  for r in range(p)]
        return [rank_memory_bytes(shape, chunks[r], r, p, 2, settings, in_flight=sim.peak_in_flight[r], head_rank=0)["activations"]
                for r in range(p)]
    n = len(roles) // p
    return [rank_memory_bytes(shape, [roles[r * n:(r + 1) * n]], r, p, 1, settings, in_flight=sim.peak_in_flight[r])["activations"]
            for r in range(p)]


def sent_messages_per_rank(schedule: ScheduleActions) -> list[int]:
    """Messages each rank sends per iteration (the ``SEND_*`` actions of its lists)."""
    return [sum(a.kind.startswith("SEND") for a in actions) for actions in schedule.p2p_lists]


def run_schedule_bench(cfg: ScheduleBenchConfig, log=print) -> dict:
    """Measure every schedule (inside a process group of ``p`` ranks, PP = p); the BENCH record."""
    from epas_megatron.assembly import memory_kernels, plan_for_preset
    from epas_megatron.bench.common import bench_variant, default_backend
    from epas_megatron.engine.pipeline_executor import executed_bubble, record_timelines
    from epas_megatron.engine.step import train_step
    from epas_megatron.model.fusions import KernelAvailability
    from epas_megatron.sharing.shape import region_layers

    p, rank = dist.get_world_size(), dist.get_rank()
    arch = plan_for_preset(cfg.preset, seq_length=cfg.seq_length).arch
    sharing = region_layers(arch.num_layers, cfg.region, flag="--region") if cfg.region else ()
    m = cfg.num_microbatches
    schedules = {name: build_schedule(name, p, m) for name in cfg.schedules}
    variants = {}
    for name in cfg.schedules:
        plan = plan_for_preset(cfg.preset, sharing, seq_length=cfg.seq_length, share=cfg.share, backend=default_backend(),
                               core_attention=cfg.core_attention, pp=p,
                               v_stage_sizes=even_v_stage_sizes(arch.num_layers, p) if PIPELINE_SCHEDULES[name].v_placement else None)
        variants[name] = bench_variant(plan, micro_batch_size=cfg.micro_batch_size, num_microbatches=m, seed=cfg.seed)
    precision = next(iter(variants.values())).state.plan.precision
    layer_shape = ModelShape(arch, cfg.seq_length, cfg.micro_batch_size)
    memory_settings = RankMemorySettings(num_microbatches=m, precision=precision, share=cfg.share,
                                         **memory_kernels(KernelAvailability.detect(), default_backend()))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log(f"bench pipeline --schedule: {cfg.preset} ({arch.num_layers} layers, h {arch.hidden_size}), p {p} (one rank per process), "
        f"{m} micro-batches of {cfg.micro_batch_size} x seq {cfg.seq_length}, region {cfg.region} {list(sharing)}, {precision} on "
        f"{device}; per schedule {cfg.warmup} warm-up + 1 memory + {cfg.iters} timed iterations")
    losses: dict[str, list[float]] = {name: [] for name in cfg.schedules}

    def step(name):
        v = variants[name]
        result = train_step(v.state.model, v.state.optimizer, v.state.scheduler, v.data, num_microbatches=m,
                            seq_length=v.state.schedule_seq_length, micro_batch_size=cfg.micro_batch_size,
                            pipeline_schedule=schedules[name])
        losses[name].append(result.lm_loss)

    for name in cfg.schedules:
        for _ in range(cfg.warmup):
            step(name)
    peaks = {}
    for name in cfg.schedules:
        _sync()
        peaks[name] = measure_peak_bytes(lambda: step(name))
    times: dict[str, list[float]] = {name: [] for name in cfg.schedules}
    timelines: dict[str, list] = {name: [] for name in cfg.schedules}
    for i in range(cfg.iters):
        for name in cfg.schedules if i % 2 == 0 else cfg.schedules[::-1]:
            _sync()
            start = time.perf_counter()
            with record_timelines() as recorded:
                step(name)
            _sync()
            times[name].append(time.perf_counter() - start)
            (timeline,) = recorded
            timelines[name].append(timeline)

    gathered = [None] * p
    dist.all_gather_object(gathered, {"rank": rank, "peaks": peaks, "timelines": timelines, "times": times})
    gathered.sort(key=lambda g: g["rank"])
    rows = []
    for name in cfg.schedules:
        schedule = schedules[name]
        per_iteration = [[g["timelines"][name][i] for g in gathered] for i in range(cfg.iters)]
        everything = [t for ranks in per_iteration for t in ranks]
        costs = pass_costs_of(everything, schedule)
        per_stage = stage_pass_seconds(everything)
        replayed = replay(schedule, lambda a: per_stage[(a.kind, a.stage)])[0]
        sent = [g["timelines"][name][0].sent_bytes for g in gathered]
        rows.append({
            "schedule": name,
            "seconds_per_iteration": statistics.median(max(g["times"][name][i] for g in gathered) for i in range(cfg.iters)),
            "bubble_executed": statistics.median(executed_bubble(ranks) for ranks in per_iteration),
            "bubble_executed_per_rank": [statistics.median(t.bubble for t in (ranks[r] for ranks in per_iteration)) for r in range(p)],
            "bubble_replayed": replayed,
            "bubble_simulated_mean_pass_costs": simulate(schedule, costs).bubble,
            "bubble_simulated_unit_costs": simulate(schedule).bubble,
            "pass_seconds": {"F": costs.forward, "B": costs.input_grad, "W": costs.weight_grad},
            "peak_bytes_per_rank": [g["peaks"][name] for g in gathered],
            "in_flight_simulated_per_rank": simulate(schedule).peak_in_flight,
            "modelled_activation_bytes_per_rank": modelled_activation_bytes(variants[name].state.plan, schedule, memory_settings,
                                                                            layer_shape),
            "p2p_sent_bytes_per_rank": sent,
            "p2p_sent_messages_per_rank": [g["timelines"][name][0].sent_messages for g in gathered],
            "p2p_received_bytes_per_rank": [g["timelines"][name][0].received_bytes for g in gathered],
            "losses": losses[name],
            "final_loss": losses[name][-1],
        })
    reference = rows[0]
    for row in rows:
        row["seconds_vs_first"] = row["seconds_per_iteration"] / reference["seconds_per_iteration"]
        row["peak_vs_first"] = max(row["peak_bytes_per_rank"]) / max(reference["peak_bytes_per_rank"])
    max_loss_difference = max(abs(a - b) for row in rows for a, b in zip(row["losses"], reference["losses"]))
    tolerance = 1e-5 if precision == "fp32" else 1e-2
    losses_agree = max_loss_difference <= tolerance * abs(reference["final_loss"])
    steps = len(reference["losses"])
    _log_measured(rows, device, steps, log)
    log(f"losses after {steps} steps {'agree' if losses_agree else 'DO NOT agree'} across schedules: largest difference "
        f"from {reference['schedule']} over all steps {max_loss_difference:.3g} (tolerance {tolerance:g} x the loss, {precision})")
    predicted = predicted_gpu_table(log=log)
    return {"preset": cfg.preset, "p": p, "num_microbatches": m, "micro_batch_size": cfg.micro_batch_size,
            "seq_length": cfg.seq_length, "region": cfg.region, "precision": precision, "device": device,
            "iters": cfg.iters, "warmup": cfg.warmup, "schedules": rows, "max_loss_difference": max_loss_difference,
            "losses_agree": losses_agree, "predicted_gpu": predicted}


def _log_measured(rows: list[dict], device: str, steps: int, log) -> None:
    first = rows[0]["schedule"]
    note = "CPU: memory and correctness, not speed" if device == "cpu" else "GPU: measured"
    log(f"MEASURED ({note}); peaks above the iteration's start; p2p = bytes each rank sent per iteration:")
    log(f"| schedule | s/iter (median) | vs {first} | bubble executed | bubble replayed (this run's stage pass times) "
        f"| bubble sim (F=B=W) | peak MiB per rank (measured) | busiest rank vs {first} | in-flight per rank (sim) "
        f"| activations MiB per rank (memory model) | p2p MiB sent per rank | loss after {steps} steps |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    per_rank = lambda values, scale, digits: " / ".join(f"{v / scale:.{digits}f}" for v in values)  # noqa: E731
    for row in rows:
        log(f"| {row['schedule']} | {row['seconds_per_iteration']:.3f} | {row['seconds_vs_first']:.3f} | {row['bubble_executed']:.3f} "
            f"| {row['bubble_replayed']:.3f} | {row['bubble_simulated_unit_costs']:.3f} "
            f"| {per_rank(row['peak_bytes_per_rank'], MIB, 1)} | {row['peak_vs_first']:.3f} "
            f"| {' / '.join(f'{x:g}' for x in row['in_flight_simulated_per_rank'])} "
            f"| {per_rank(row['modelled_activation_bytes_per_rank'], MIB, 1)} "
            f"| {per_rank(row['p2p_sent_bytes_per_rank'], MIB, 2)} | {row['final_loss']:.6f} |")


# ---------------------------------------------------------------------------- predicted
def modelled_pass_costs(shape: ModelShape, layers_per_rank: int, micro_batch_size: int = 1,
                        p2p_flops_per_byte: float = P2P_FLOPS_PER_BYTE, element_bytes: int = 2) -> PassCosts:
    """FLOP costs of one micro-batch through ``layers_per_rank`` decoder layers (see the module
    doc): ``F`` = GEMMs + attention core, ``B`` = GEMMs + 2 x attention core, ``W`` = GEMMs; a
    message ``s x b x h`` activations at ``p2p_flops_per_byte``."""
    mm = layer_matmul_flops(shape, Convention.MEGATRON)
    core = mm.attention_scores + mm.attention_values
    gemms = mm.total - core
    n, b = layers_per_rank, micro_batch_size
    message = shape.seq_length * b * shape.hidden_size * element_bytes
    return PassCosts(forward=n * b * (gemms + core), input_grad=n * b * (gemms + 2 * core), weight_grad=n * b * gemms,
                     p2p=message * p2p_flops_per_byte)


def predicted_rows(preset: str = "7b", pps: Sequence[int] = (4, 8), microbatches_per_rank: int = 4,
                   schedules: Sequence[str] = BENCH_SCHEDULES, p2p_flops_per_byte: float = P2P_FLOPS_PER_BYTE) -> list[dict]:
    """The prediction for ``preset`` (no sharing, bf16, micro-batch 1, ``m = microbatches_per_rank x p``)."""
    from epas_megatron.config.presets import get_preset

    pre = get_preset(preset)
    s, b = pre.seq_length, 1
    shape = ModelShape(architecture_from_preset(pre, s), s, b)
    message = s * b * shape.hidden_size * 2
    rows = []
    for p in pps:
        m = microbatches_per_rank * p
        costs = modelled_pass_costs(shape, shape.num_layers // p, b, p2p_flops_per_byte)
        settings = RankMemorySettings(num_microbatches=m, precision="bf16",
                                      fused_norm=True, fused_swiglu=True)
        base_time = None
        for name in schedules:
            schedule = build_schedule(name, p, m)
            sim = simulate(schedule, costs)
            base_time = base_time or sim.makespan
            if schedule.v_placement:
                sizes = even_v_stage_sizes(shape.num_layers, p)
                roles = lambda r: [["compute"] * sizes[v_stage(r, c, p)] for c in (0, 1)]  # noqa: E731
                memory = [rank_memory_bytes(shape, roles(r), r, p, 2, settings, in_flight=sim.peak_in_flight[r], head_rank=0)
                          for r in range(p)]
            else:
                memory = [rank_memory_bytes(shape, [["compute"] * (shape.num_layers // p)], r, p, 1, settings,
                                            in_flight=sim.peak_in_flight[r]) for r in range(p)]
            rows.append({"preset": preset, "p": p, "m": m, "schedule": name, "bubble": sim.bubble,
                         "time_vs_1f1b": sim.makespan / base_time, "peak_in_flight": max(sim.peak_in_flight),
                         "activations_gib": max(r["activations"] for r in memory) / GIB,
                         "total_gib": max(r["total"] for r in memory) / GIB,
                         "activations_gib_per_rank": [r["activations"] / GIB for r in memory],
                         "p2p_gib_per_rank": [n * message / GIB for n in sent_messages_per_rank(schedule)]})
    return rows


def predicted_gpu_table(log=print, **kwargs) -> list[dict]:
    """Print :func:`predicted_rows` as a table marked as a prediction; return the rows."""
    rows = predicted_rows(**kwargs)
    log("PREDICTED, not measured: 7b (32 layers, h 4096, seq 2048, micro-batch 1, bf16, no sharing), m = 4p micro-batches; "
        "time from the schedule simulation with FLOP pass costs (W = the GEMMs' weight gradients, B = their input "
        "gradients + the attention core's backward) and p2p at the cost model's FLOPs per byte; memory from the memory "
        "model with the simulation's in-flight peak per rank (the largest over the ranks shown)")
    log("| p | m | schedule | bubble (sim) | iteration time vs 1f1b (sim) | peak in-flight (micro-batches) | activations GiB "
        "(max rank) | total GiB (max rank) | p2p GiB sent per rank per iteration |")
    log("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        log(f"| {row['p']} | {row['m']} | {row['schedule']} | {row['bubble']:.3f} | {row['time_vs_1f1b']:.3f} "
            f"| {row['peak_in_flight']:g} | {row['activations_gib']:.1f} | {row['total_gib']:.1f} "
            f"| {' / '.join(f'{g:.2f}' for g in row['p2p_gib_per_rank'])} |")
    return rows

