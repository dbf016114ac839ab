"""A per-rank memory budget for the stage balancer (``--epas-memory-budget-gb``).

Rebalancing moves layers toward the first pipeline stages as the sharing region grows at the
deep end -- and under 1F1B the first stage keeps the most micro-batches in flight (``pp``
against the last stage's one), so a FLOP-balanced layout can need more memory there than the
even split did. :class:`MemoryLimit` prices a rank with :mod:`epas_megatron.metrics.memory_model`
(its layers' weights, gradients and Adam state; their activations times the rank's in-flight
micro-batches; the embedding on the first rank, the LM head on the last, a received hand-off)
and tells the balancer's search which ranks fit; among the layouts whose every rank fits, the
balancer still minimises the slowest rank. :func:`layout_within_budget` also reports when the
FLOP-optimal layout would not have fitted. :meth:`MemoryLimit.switch_bytes` prices a rank through
an in-memory switch (``epas-plan`` checks it against the budget; the balancer does not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from epas_megatron.metrics.rank_memory import RankMemorySettings, layer_memory, rank_memory_bytes
from epas_megatron.metrics.switch_memory import switch_transient_terms
from epas_megatron.model.architecture import ModelShape
from epas_megatron.sharing.shape import LayerMode

GIB = 2**30


@dataclass
class MemoryLimit:
    """Which pipeline ranks fit ``budget_bytes`` (see module doc)."""

    shape: ModelShape
    """The model at the run's sequence length and micro-batch size."""

    settings: RankMemorySettings
    """Precision, TP/DP, optimizer, recompute, micro-batches."""

    pp: int
    """Pipeline ranks."""

    vpp: int
    """Chunks per rank."""

    budget_bytes: float
    """The most one rank may hold."""

    failure: str = field(default="", init=False)
    """Why no layout fits (set by :meth:`for_modes`, read by the balancer)."""

    def rank_bytes(self, pp_rank: int, roles_by_chunk: Sequence[Sequence[str]]) -> dict[str, float]:
        return rank_memory_bytes(self.shape, [list(r) for r in roles_by_chunk], pp_rank, self.pp, self.vpp, self.settings)

    def for_modes(self, modes: Sequence[LayerMode]):
        """``fits(rank, starts, ends)`` for the balancer, at the region ``modes``."""
        roles = ["share" if m == LayerMode.SHARE else "compute" for m in modes]
        per_layer = {role: layer_memory(self.shape, role, self.settings) for role in ("compute", "share")}
        smallest = min(per_layer[r][0] + per_layer[r][1] for r in set(roles))
        self.failure = (f"no pipeline layout keeps every rank within --epas-memory-budget-gb {self.budget_bytes / GIB:g} "
                        f"(one layer alone needs {smallest / GIB:.2f} GiB plus its stage's share of the embedding, LM head "
                        f"and in-flight activations); raise the budget, --pp, or lower the micro-batch size")

        def fits(pp_rank: int, starts: Sequence[int], ends: Sequence[int]) -> bool:
            chunks = [roles[a:b] for a, b in zip(starts, ends)]
            return self.rank_bytes(pp_rank, chunks)["total"] <= self.budget_bytes

        fits.failure = self.failure  # the balancer's error when nothing fits
        return fits

    def layout_bytes(self, layout, modes: Sequence[LayerMode]) -> list[dict[str, float]]:
        """Per-rank memory of a :class:`~epas_megatron.model.stage_layout.StageLayout`."""
        roles = ["share" if m == LayerMode.SHARE else "compute" for m in modes]
        out = []
        for rank in range(self.pp):
            chunks = [[roles[i] for i in layout.layer_ids(rank, c)] for c in range(self.vpp)]
            out.append(self.rank_bytes(rank, chunks))
        return out

    def switch_bytes(self, layout_before, modes_before: Sequence[LayerMode], layout_after,
                     modes_after: Sequence[LayerMode]) -> list[dict[str, float]]:
        """Per-rank memory of an in-memory switch (``--epas-switch-mode memory``) from one region
        and layout to the next: ``parameters`` (the state before it), ``transient`` (what the
        switch allocates above that state:
        :func:`~epas_megatron.metrics.switch_memory.switch_transient_terms`) and ``peak``, their
        sum. No micro-batch is in flight during a switch. ``step_peak``: the larger of the rank's
        step peaks (state and activations) in the regions before and after the switch."""
        roles_before = ["share" if m == LayerMode.SHARE else "compute" for m in modes_before]
        roles_after = ["share" if m == LayerMode.SHARE else "compute" for m in modes_after]
        out = []
        for rank in range(self.pp):
            chunks = [list(layout_before.layer_ids(rank, c)) for c in range(self.vpp)]
            chunks_after = [list(layout_after.layer_ids(rank, c)) for c in range(self.vpp)]
            step_before = self.rank_bytes(rank, [[roles_before[i] for i in chunk] for chunk in chunks])
            step_after = self.rank_bytes(rank, [[roles_after[i] for i in chunk] for chunk in chunks_after])
            parameters = step_before["parameters"]
            after = [i for chunk in chunks_after for i in chunk]
            transient = switch_transient_terms(self.shape, roles_before, roles_after, [i for chunk in chunks for i in chunk], after,
                                               rank, self.pp, self.settings)["transient"]
            out.append({"parameters": parameters, "transient": transient, "peak": parameters + transient,
                        "step_peak": max(step_before["total"], step_after["total"])})
        return out


def layout_within_budget(unconstrained, constrained, limit: Optional[MemoryLimit], modes) -> tuple[object, Optional[str]]:
    """(the layout to use, a notice or None): the FLOP-optimal layout when every rank fits (or
    there is no budget), else the best one that fits, with a notice naming the rank and bytes
    the FLOP-optimal one would have needed."""
    best = unconstrained()
    if limit is None:
        return best, None
    need = limit.layout_bytes(best, modes)
    worst = max(range(limit.pp), key=lambda r: need[r]["total"])
    if need[worst]["total"] <= limit.budget_bytes:
        return best, None
    chosen = constrained()
    have = limit.layout_bytes(chosen, modes)
    return chosen, (f"the FLOP-optimal layout {best.to_layout_string()} would need {need[worst]['total'] / GIB:.4g} GiB on "
                    f"pipeline rank {worst} (budget {limit.budget_bytes / GIB:g} GiB); using {chosen.to_layout_string()} "
                    f"(at most {max(h['total'] for h in have) / GIB:.4g} GiB per rank, bottleneck "
                    f"{chosen.bottleneck / best.bottleneck:.3f}x)")


def memory_limit_for(plan, settings: RankMemorySettings, micro_batch_size: int, budget_gb: Optional[float]) -> Optional[MemoryLimit]:
    """The limit for a :class:`~epas_megatron.model.build_plan.BuildPlan` (None: no budget)."""
    if budget_gb is None:
        return None
    return MemoryLimit(ModelShape(plan.arch, plan.seq_length, micro_batch_size), settings, plan.pp, plan.vpp or 1, budget_gb * GIB)

