"""Pipeline-stage planner: where each decoder layer lives, re-planned at every EPAS switch.

Megatron-Core splits the decoder layers ``0 .. L-1`` into ``p * v`` contiguous blocks, the
*virtual stages*, for ``p`` pipeline ranks (``--pp``) and ``v`` model chunks per rank
(``--vpp``). Virtual stage ``k`` (the ``k``-th block) is held by pipeline rank ``k % p`` as its
chunk ``k // p`` (interleaved order: ``k = vp_stage * p + pp_rank``). The embedding lives on
virtual stage 0, the output layer and loss on virtual stage ``p*v - 1``.

All chunks of one rank run on the same GPU, so a rank's time per microbatch is the sum of its
chunks' costs, and the pipeline runs at the pace of its slowest rank. :func:`plan_layout` picks
the split that minimises that slowest rank's cost (the *bottleneck*). Among equally fast splits
(bottlenecks within 1e-9 of the total cost) it takes the one moving the fewest layers away from
the layout in use (each moved layer means moving its parameters and optimizer state at the
switch), then the one nearest Megatron's even split, then the smallest stage ends listed rank by
rank (fewer layers on early ranks, which under 1F1B hold the most in-flight activations).

:class:`StageLayout` turns into Megatron-Core's ``pipeline_model_parallel_layout`` string
(``--pipeline-model-parallel-layout`` in Megatron's own arguments), e.g. ``"Ettt|ttt|ttL"``.

How the search works, and where it is exact:

- ``v == 1``: the classic linear partition, solved exactly (bisection on the bottleneck with a
  reachability check, then a dynamic program for the tie-breaks).
- ``v == 2``: exact and fast. With round 0 ending at ``R``, rank ``r`` holds
  ``[x_{r-1}, x_r)`` and ``[y_{r-1}, y_r)``, so its cost depends only on two consecutive pairs
  ``(x, y)``: a dynamic program over ranks on pair states, for each ``R``.
- ``v >= 3``: branch and bound over the blocks before the last round, the last round (one block
  per rank) solved exactly per branch. Bounds: per-rank and total capacity, how many of the
  remaining layers (cheapest first) still fit, and, with at most two distinct layer costs (EPAS
  compute/share), the largest sum of remaining layers each rank can still take; a lower bound
  (the same, at the root, plus the layers dealt out as a multiset) stops the search when met.

Every phase has a deterministic work budget (:data:`DEFAULT_SEARCH_BUDGET`, about 0.4 s). When
a search exceeds it (seen only for ``v >= 3`` on 48+ layers with ``p = 8``, and for the
tie-breaks of very large shapes), the planner returns the best layout found, flagged
``optimal=False`` (with ``bottleneck_lower_bound`` saying how far off it can be) or
``ties_resolved=False``; the layout is valid either way. Budgets are counted, not timed, so every
rank planning the same inputs gets the same layout.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from epas_megatron.errors import ConfigError
from epas_megatron.parallel.cost_model import LayerCosts, costs_for_modes

DEFAULT_SEARCH_BUDGET = 60_000
"""Work units per search phase (3-7 microseconds each on one CPU core, so at most about 0.4 s)
before :func:`plan_layout` settles for the best layout found so far. Counted, not timed, so
every rank that plans the same inputs gets the same layout."""

_REL_TOL = 1e-9
"""Bottlenecks within this fraction of the total cost count as equal (tie-breaking applies)."""


# --------------------------------------------------------------------------------------------
# The layout


@dataclass(frozen=True)
class StageLayout:
    """A split of decoder layers ``0 .. num_layers-1`` into ``p * v`` contiguous virtual stages.

    Virtual stage ``k = vp_stage * p + pp_rank`` holds the ``k``-th block (Megatron-Core's
    interleaved order); the embedding is on virtual stage 0 and the output layer and loss on the
    last one.
    """

    stage_sizes: tuple[int, ...]
    """Decoder layers per virtual stage, in virtual-stage order (length ``p * v``)."""

    pipeline_parallel_size: int
    """``p`` (``--pp``)."""

    virtual_pipeline_parallel_size: int = 1
    """``v`` (``--vpp``): model chunks per pipeline rank."""

    virtual_stage_costs: tuple[float, ...] | None = None
    """Predicted cost per virtual stage (decoder layers, plus embedding on the first and output
    layer + loss on the last), or None for a layout without costs."""

    rank_costs: tuple[float, ...] | None = None
    """Predicted cost per pipeline rank (physical stage): the sum of its virtual stages."""

    moved_layers: int = 0
    """Layers whose ``(pp_rank, vp_stage)`` differs from the layout the planner started from."""

    optimal: bool = True
    """False only when the planner's search ran out of budget before proving the bottleneck
    minimal (see ``bottleneck_lower_bound`` for how far off it can be)."""

    ties_resolved: bool = True
    """False only when the search ran out of budget while breaking ties among equally fast
    layouts (fewest moved layers, ...): the layout is then the best tie-break found."""

    bottleneck_lower_bound: float | None = None
    """From the planner: no split has a smaller bottleneck (equal to ``bottleneck`` once the
    bottleneck is proven minimal); None for layouts not made by the planner."""

    def __post_init__(self):
        p, v = self.pipeline_parallel_size, self.virtual_pipeline_parallel_size
        if p < 1 or v < 1:
            raise ValueError(f"StageLayout: p and v must be >= 1, got p={p}, v={v}")
        if len(self.stage_sizes) != p * v:
            raise ValueError(
                f"StageLayout: {len(self.stage_sizes)} stage sizes for p={p} x v={v} = {p * v} "
                "virtual stages"
            )
        if any(size < 0 for size in self.stage_sizes):
            raise ValueError(f"StageLayout: negative stage size in {self.stage_sizes}")
        if self.virtual_stage_costs is not None and len(self.virtual_stage_costs) != p * v:
            raise ValueError("StageLayout: virtual_stage_costs needs one entry per virtual stage")
        if self.rank_costs is not None and len(self.rank_costs) != p:
            raise ValueError("StageLayout: rank_costs needs one entry per pipeline rank")

    # ---- construction

    @classmethod
    def from_sizes(
        cls,
        stage_sizes: Sequence[int],
        pipeline_parallel_size: int,
        virtual_pipeline_parallel_size: int = 1,
        costs: Sequence[float] | None = None,
        embedding_cost: float = 0.0,
        output_cost: float = 0.0,
    ) -> StageLayout:
        """A layout with the given per-virtual-stage sizes, costed with ``costs`` (one per
        decoder layer) when given."""
        sizes = tuple(int(size) for size in stage_sizes)
        p, v = pipeline_parallel_size, virtual_pipeline_parallel_size
        stage_costs = rank_costs = None
        if costs is not None:
            if len(costs) != sum(sizes):
                raise ValueError(f"StageLayout: {len(costs)} layer costs for {sum(sizes)} layers")
            stage_costs_list, start = [], 0
            for size in sizes:
                stage_costs_list.append(math.fsum(costs[start : start + size]))
                start += size
            stage_costs_list[0] += embedding_cost
            stage_costs_list[-1] += output_cost
            stage_costs = tuple(stage_costs_list)
            rank_costs = tuple(math.fsum(stage_costs[r::p]) for r in range(p))
        return cls(sizes, p, v, stage_costs, rank_costs)

    @classmethod
    def even(
        cls,
        num_layers: int,
        pipeline_parallel_size: int,
        virtual_pipeline_parallel_size: int = 1,
        costs: Sequence[float] | None = None,
        embedding_cost: float = 0.0,
        output_cost: float = 0.0,
    ) -> StageLayout:
        """Megatron's default split: ``num_layers / (p*v)`` layers per virtual stage. When that
        does not divide (Megatron would refuse), the first ``num_layers % (p*v)`` virtual stages
        get one layer more."""
        num_stages = pipeline_parallel_size * virtual_pipeline_parallel_size
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if k < extra else 0) for k in range(num_stages)]
        return cls.from_sizes(
            sizes,
            pipeline_parallel_size,
            virtual_pipeline_parallel_size,
            costs,
            embedding_cost,
            output_cost,
        )

    @classmethod
    def from_layout_string(cls, layout: str, pipeline_parallel_size: int) -> StageLayout:
        """Parse a ``pipeline_model_parallel_layout`` string (Megatron-Core's syntax, parsed by
        Megatron-Core) holding decoder layers, one ``E`` at the start and one ``L`` at the end.
        The result has no costs."""
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )

        if not isinstance(pipeline_parallel_size, int) or pipeline_parallel_size < 1:
            raise ConfigError(f"--pp must be an integer >= 1, got {pipeline_parallel_size!r}")
        try:
            stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
        except AssertionError as error:
            raise ConfigError(f"--pipeline-layout {layout!r}: {error}") from None
        names = [[layer.name for layer in stage] for stage in stages]
        if len(names) % pipeline_parallel_size:
            raise ConfigError(
                f"--pipeline-layout {layout!r} has {len(names)} stages, which --pp "
                f"{pipeline_parallel_size} does not divide"
            )
        flat = [name for stage in names for name in stage]
        if (
            flat[:1] != ["embedding"]
            or names[0][:1] != ["embedding"]
            or flat[-1:] != ["loss"]
            or names[-1][-1:] != ["loss"]
            or flat.count("embedding") != 1
            or flat.count("loss") != 1
            or any(name not in ("embedding", "loss", "decoder") for name in flat)
        ):
            raise ConfigError(
                f"--pipeline-layout {layout!r}: expected 'E' opening the first stage, 'L' "
                "closing the last, and only decoder layers 't' otherwise"
            )
        sizes = [stage.count("decoder") for stage in names]
        return cls(tuple(sizes), pipeline_parallel_size, len(names) // pipeline_parallel_size)

    # ---- queries

    @property
    def num_layers(self) -> int:
        return sum(self.stage_sizes)

    @property
    def num_virtual_stages(self) -> int:
        return len(self.stage_sizes)

    @property
    def bottleneck(self) -> float:
        """The slowest pipeline rank's predicted cost (needs costs)."""
        if self.rank_costs is None:
            raise ValueError("StageLayout.bottleneck: this layout has no costs")
        return max(self.rank_costs)

    def virtual_stage(self, pp_rank: int, vp_stage: int = 0) -> int:
        """Index ``k`` of the block held by ``pp_rank`` as chunk ``vp_stage``."""
        p, v = self.pipeline_parallel_size, self.virtual_pipeline_parallel_size
        if not (0 <= pp_rank < p and 0 <= vp_stage < v):
            raise IndexError(f"no (pp_rank={pp_rank}, vp_stage={vp_stage}) for p={p}, v={v}")
        return vp_stage * p + pp_rank

    def layer_range(self, pp_rank: int, vp_stage: int = 0) -> range:
        """Global decoder-layer indices (0-based) held by ``pp_rank``'s chunk ``vp_stage``."""
        k = self.virtual_stage(pp_rank, vp_stage)
        start = sum(self.stage_sizes[:k])
        return range(start, start + self.stage_sizes[k])

    def layer_ids(self, pp_rank: int, vp_stage: int = 0) -> list[int]:
        """As Megatron-Core's ``PipelineParallelLayerLayout.get_layer_id_list``."""
        return list(self.layer_range(pp_rank, vp_stage))

    def assignment(self) -> tuple[tuple[int, int], ...]:
        """``(pp_rank, vp_stage)`` of every decoder layer, in layer order."""
        p = self.pipeline_parallel_size
        return tuple(
            (k % p, k // p) for k, size in enumerate(self.stage_sizes) for _ in range(size)
        )

    def moves_from(self, other: StageLayout) -> int:
        """How many decoder layers change ``(pp_rank, vp_stage)`` between ``other`` and this."""
        if (
            other.num_layers != self.num_layers
            or other.pipeline_parallel_size != self.pipeline_parallel_size
            or other.virtual_pipeline_parallel_size != self.virtual_pipeline_parallel_size
        ):
            raise ValueError("moves_from: layouts of different shapes")
        return sum(a != b for a, b in zip(self.assignment(), other.assignment()))

    def to_layout_string(self, compact: bool = False) -> str:
        """Megatron-Core's ``pipeline_model_parallel_layout`` string for this layout.

        Virtual stages in order ``k = 0 .. p*v-1`` joined by ``|``; ``E`` (embedding) opens
        stage 0, ``L`` (output layer + loss) closes the last one, one ``t`` per decoder layer.
        An empty stage is an empty string between two ``|``. With ``compact=True`` runs use
        Megatron's multiplication syntax (``t*4``, ``(t*4|)*6``), which it unrolls on parsing.
        """
        texts = []
        last = self.num_virtual_stages - 1
        for k, size in enumerate(self.stage_sizes):
            body = f"t*{size}" if compact and size > 3 else "t" * size
            texts.append(("E" if k == 0 else "") + body + ("L" if k == last else ""))
        if not compact:
            return "|".join(texts)
        # Fold runs of equal stages (never the first or last, which carry E/L): "(t*4|)*6,".
        parts, k = [], 0
        while k < len(texts):
            run = 1
            while 0 < k and k + run < last and texts[k + run] == texts[k]:
                run += 1
            if run > 1:
                parts.append(f"({texts[k]}|)*{run},")
            else:
                parts.append(texts[k] + ("|" if k < last else ""))
            k += run
        return "".join(parts)


# --------------------------------------------------------------------------------------------
# The search


class _SearchBudgetExceeded(Exception):
    pass


class _SearchFinished(Exception):
    """The incumbent meets the lower bound: nothing left to find."""


class _Search:
    """Min-bottleneck search over contiguous splits; see the module docstring.

    Positions ``0 .. n`` are the gaps between layers; a split is given by the end position of
    every virtual stage. ``sums[r]`` is rank ``r``'s cost so far (it starts at its embedding or
    output cost). Phase 1 (:meth:`min_bottleneck`) finds the smallest bottleneck; phase 2
    (:meth:`min_moves`) the best tie-break among splits within ``tol`` of it.
    """

    def __init__(
        self,
        costs: Sequence[float],
        p: int,
        v: int,
        embedding_cost: float,
        output_cost: float,
        min_layers: int,
        allowed_cut: list[bool],
        current: StageLayout | None,
        search_budget: int,
    ):
        self.n = n = len(costs)
        self.costs = list(costs)
        self.p, self.v, self.num_stages = p, v, p * v
        self.m = min_layers
        self.allowed = allowed_cut  # allowed[e]: a stage may end just before layer e
        self.search_budget = search_budget
        prefix = [0.0]
        for cost in costs:
            prefix.append(prefix[-1] + cost)
        self.P = prefix
        total = prefix[-1] + embedding_cost + output_cost
        # tol: bottlenecks this close tie; eps: slack for rounding in capacity checks.
        self.tol = _REL_TOL * total if total > 0 else 1e-300
        self.eps = 1e-12 * total if total > 0 else 1e-300
        self.offsets = [0.0] * p
        self.offsets[0] += embedding_cost
        self.offsets[p - 1] += output_cost
        # cheapest[i][j]: the j cheapest of layers i..n-1, summed (layer-count bound).
        self.cheapest = []
        for i in range(n + 1):
            acc, row = 0.0, [0.0]
            for cost in sorted(costs[i:]):
                acc += cost
                row.append(acc)
            self.cheapest.append(row)
        # With at most two distinct layer costs (EPAS: compute and share layers), the most a
        # rank can still take is the largest sum of remaining layers under its capacity, which
        # can be far below the capacity itself: two_costs[i] = (big, small, #big, #small) in
        # layers i..n-1.
        values = sorted(set(costs))
        self.two_costs = None
        if len(values) <= 2:
            big, small = values[-1], values[0]
            self.two_costs = []
            for i in range(n + 1):
                num_big = sum(1 for cost in costs[i:] if cost == big)
                self.two_costs.append((big, small, num_big, n - i - num_big))
        # Tie-break anchors, most important first: a split's "moves" score is the weighted count
        # of layers outside their stage in `current`, then (weight 1) in the even split, so that
        # among equal bottlenecks and equal moves from `current` the split closest to
        # Megatron's even split wins.
        anchors = ([] if current is None else [current]) + [StageLayout.even(n, p, v)]
        weighted = []
        for rank, layout in enumerate(anchors):
            weight = (n + 1) ** (len(anchors) - 1 - rank)
            ends, acc = [], 0
            for size in layout.stage_sizes:
                acc += size
                ends.append(acc)
            weighted.append((weight, [0] + ends[:-1], ends))
        self.anchor_ends = [(weight, ends) for weight, _, ends in weighted]
        # score[k][x]: the moves score of layers 0..x-1 if all were in virtual stage k, so a
        # block [s, e) in stage k scores score[k][e] - score[k][s].
        total_weight = sum(weight for weight, _, _ in weighted)
        self.score = []
        for k in range(self.num_stages):
            row, acc = [0], 0
            for x in range(n):
                acc += total_weight - sum(
                    weight for weight, starts, ends in weighted if starts[k] <= x < ends[k]
                )
                row.append(acc)
            self.score.append(row)
        # rank_major[k]: stages k.. in the order of the final tie-break (rank, then chunk).
        self.rank_major = [
            sorted(range(k, self.num_stages), key=lambda j: (j % p, j // p))
            for k in range(self.num_stages)
        ]
        self.nodes = 0

    # ---- small helpers

    def tick(self, units: int = 1):
        self.nodes += units
        if self.nodes > self.search_budget:
            raise _SearchBudgetExceeded

    def moves(self, k: int, s: int, e: int) -> int:
        """Moves score of the block ``[s, e)`` in virtual stage ``k``."""
        row = self.score[k]
        return row[e] - row[s]

    def closed_moves(self, k: int, i: int) -> int:
        """Score of the layers at or after ``i`` that an anchor keeps in stages before ``k``:
        they count whatever comes next."""
        if k == 0:
            return 0
        return sum(weight * max(0, ends[k - 1] - i) for weight, ends in self.anchor_ends)

    def key(self, k: int, i: int, sums: list[float]) -> tuple:
        return (k, i, *(round(s / self.tol) for s in sums))

    def ends_to_sizes(self, ends: Sequence[int]) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip([0, *ends[:-1]], ends))

    def bottleneck_of(self, ends: Sequence[int]) -> float:
        sums, start = list(self.offsets), 0
        for k, e in enumerate(ends):
            sums[k % self.p] += self.P[e] - self.P[start]
            start = e
        return max(sums)

    def fits(self, k: int, i: int, sums: list[float], bound: float) -> bool:
        """Necessary condition for finishing virtual stages ``k ..`` from layer ``i`` with every
        rank <= ``bound``, while every rank still has a block to come: total capacity,
        layer-count capacity (cheapest remaining layers first) and each rank's minimum layers."""
        if bound == math.inf:
            return True
        n, p, m = self.n, self.p, self.m
        slack = self.eps
        caps = [bound - s for s in sums]
        if min(caps) < -slack:
            return False
        if sum(caps) + p * slack < self.P[n] - self.P[i]:
            return False
        cheapest = self.cheapest[i]
        count = 0
        for cap in caps:
            count += bisect.bisect_right(cheapest, cap + slack) - 1
        if count < n - i:
            return False
        if self.two_costs is not None and self.two_costs[i][0] > 0:
            big, small, num_big, num_small = self.two_costs[i]
            usable = 0.0
            for cap in caps:
                cap += slack
                most = 0.0
                for a in range(min(num_big, int(cap // big)) + 1):
                    rest = cap - a * big
                    b = num_small if small == 0 else min(num_small, int(rest // small))
                    most = max(most, a * big + b * small)
                usable += most
            if usable + p * slack < self.P[n] - self.P[i]:
                return False
        if m:
            blocks_left = self.num_stages - k
            for r in range(p):
                owed = m * ((blocks_left - (r - k) % p + p - 1) // p)
                if cheapest[owed] > caps[r] + slack:
                    return False
        return True

    @staticmethod
    def water_level(sums: list[float], remaining: float) -> float:
        """The level W with sum(max(0, W - s)) == remaining: where the ranks would end if the
        remaining cost could be poured freely."""
        ordered = sorted(sums)
        acc = 0.0
        for j, s in enumerate(ordered):
            acc += s
            level = (remaining + acc) / (j + 1)
            if j + 1 == len(ordered) or level <= ordered[j + 1]:
                return level
        raise AssertionError("unreachable")

    # ---- a lower bound on the bottleneck of any split

    def lower_bound(self) -> float:
        """The best of: the water level, the smallest bound passing :meth:`fits` at the root,
        and (when the layers have at most two distinct costs, as with EPAS compute/share
        layers) the smallest bound at which the layers can be dealt out to the ranks as a
        multiset, ignoring contiguity."""
        offsets, total = self.offsets, self.P[self.n]
        low = max(max(offsets), self.water_level(offsets, total))
        high = max(offsets) + total
        for _ in range(100):
            if high - low <= self.tol:
                break
            mid = 0.5 * (low + high)
            if self.fits(0, 0, offsets, mid):
                high = mid
            else:
                low = mid
        bound = low
        values = sorted(set(self.costs))
        if len(values) == 2:
            bound = max(bound, self._two_cost_bound(values[1], values[0]))
        return bound

    def _two_cost_bound(self, big: float, small: float) -> float:
        """Smallest B such that some counts (a_r, b_r) of big/small layers per rank, with
        ``offsets[r] + a_r*big + b_r*small <= B``, add up to the layers there are."""
        num_big = sum(1 for cost in self.costs if cost == big)
        num_small = self.n - num_big
        offsets, p = self.offsets, self.p

        def feasible(bound: float) -> bool:
            best_small = {0: 0}  # big layers placed (capped) -> most small layers placeable
            for r in range(p):
                cap = bound - offsets[r] + self.eps
                if cap < 0:
                    return False
                step: dict[int, int] = {}
                most_big = min(num_big, int(cap // big))
                for a in range(most_big + 1):
                    b = num_small if small == 0 else min(num_small, int((cap - a * big) // small))
                    for placed, smalls in best_small.items():
                        key, value = min(num_big, placed + a), min(num_small, smalls + b)
                        if step.get(key, -1) < value:
                            step[key] = value
                best_small = step
            return best_small.get(num_big, -1) >= num_small

        candidates = sorted(
            {
                offset + a * big + b * small
                for offset in set(offsets)
                for a in range(num_big + 1)
                for b in range(num_small + 1)
            }
        )
        lo, hi = 0, len(candidates) - 1  # the last candidate (everything on one rank) works
        while lo < hi:
            mid = (lo + hi) // 2
            if feasible(candidates[mid]):
                hi = mid
            else:
                lo = mid + 1
        return candidates[lo]

    # ---- the last round: one block per rank, ranks 0 .. p-1 in order

    def last_round_reach(self, i: int, caps: list[float]) -> list[list[bool]] | None:
        """Reachable start positions of each last-round block under per-rank capacities (and
        a final row with the reachable ends), or None when ``n`` is not reachable."""
        n, p, m, P, allowed = self.n, self.p, self.m, self.P, self.allowed
        reach = [False] * (n + 1)
        reach[i] = True
        rows = [reach]
        for t in range(p):
            end_max = n - m * (p - 1 - t)
            diff = [0] * (n + 2)
            cap = caps[t] + self.eps
            found = False
            hi = i
            for s in range(i, end_max + 1 - m):
                if reach[s]:
                    limit = P[s] + cap
                    if hi < s:
                        hi = s
                    while hi < end_max and P[hi + 1] <= limit:  # hi: last end within capacity
                        hi += 1
                    if s + m <= hi and P[hi] <= limit:
                        diff[s + m] += 1
                        diff[hi + 1] -= 1
                        found = True
            if not found:
                return None
            reach, run = [False] * (n + 1), 0
            for e in range(n + 1):
                run += diff[e]
                reach[e] = run > 0 and allowed[e]
            rows.append(reach)
        return rows if reach[n] else None

    def last_round_feasible(self, i: int, sums: list[float], bound: float) -> list[int] | None:
        """Ends of a last round from layer ``i`` keeping every rank <= ``bound``, or None."""
        self.tick(1 + self.p * (self.n - i) // 25)
        caps = [bound - s for s in sums]
        if min(caps) < -self.eps:
            return None
        rows = self.last_round_reach(i, caps)
        if rows is None:
            return None
        P, m = self.P, self.m
        ends, e = [], self.n
        for t in range(self.p - 1, -1, -1):
            ends.append(e)
            cap = caps[t] + self.eps
            for s in range(e - m, i - 1, -1):  # latest start that can end at e
                if rows[t][s] and P[e] <= P[s] + cap:
                    e = s
                    break
            else:  # pragma: no cover - reachability guarantees a start
                raise AssertionError("last round: lost the reconstruction")
        ends.reverse()
        return ends

    def last_round_max(self, i: int, sums: list[float], ends: list[int]) -> float:
        start, worst = i, -math.inf
        for t, e in enumerate(ends):
            worst = max(worst, sums[t] + self.P[e] - self.P[start])
            start = e
        return worst

    def best_last_round(
        self, i: int, sums: list[float], bound: float, floor: float
    ) -> tuple[float, list[int]] | None:
        """The smallest-maximum last round from ``i`` if its maximum is <= ``bound`` (within
        ``tol``; nothing is below ``floor``), or None."""
        ends = self.last_round_feasible(i, sums, bound)
        if ends is None:
            return None
        best = self.last_round_max(i, sums, ends)
        low = max(floor, max(sums), self.water_level(sums, self.P[self.n] - self.P[i]))
        low -= self.tol
        for _ in range(64):  # bisection on the bound
            if best - low <= self.tol:
                break
            mid = 0.5 * (low + best)
            trial = self.last_round_feasible(i, sums, mid)
            if trial is None:
                low = mid
                continue
            value = self.last_round_max(i, sums, trial)
            if value >= best:
                low = mid
                continue
            ends, best = trial, value
        return best, ends

    def last_round_min_moves(
        self, i: int, sums: list[float], cap: float
    ) -> tuple[int, tuple[int, ...]] | None:
        """Smallest moves score over last rounds from ``i`` with every rank <= ``cap``, and the
        lexicographically smallest block sizes among those; None if there is none."""
        self.tick(1 + self.p * (self.n - i) // 20)
        n, p, m, P, allowed = self.n, self.p, self.m, self.P, self.allowed
        base = p * (self.v - 1)
        inf = math.inf
        # tables[t][s]: best score of blocks t .. p-1 when block t starts at s.
        tables: list[list[float]] = [[inf] * (n + 1) for _ in range(p + 1)]
        tables[p][n] = 0
        for t in range(p - 1, -1, -1):
            cap_t = cap - sums[t] + self.eps
            end_max = n - m * (p - 1 - t)
            score, after, here = self.score[base + t], tables[t + 1], tables[t]
            # Block t from s ends in [s + m, hi(s)], a window whose both ends grow with s: keep
            # a sliding-window minimum of score[e] + after[e] (earliest e first among equals).
            window: collections.deque[tuple[float, int]] = collections.deque()
            pushed = hi = i + m * t + m
            for s in range(i + m * t, end_max + 1 - m):
                limit = P[s] + cap_t
                while hi < end_max and P[hi + 1] <= limit:  # hi: last end within capacity
                    hi += 1
                while pushed <= hi and P[pushed] <= limit:
                    rest = after[pushed]
                    if rest < inf and allowed[pushed]:
                        value = score[pushed] + rest
                        while window and window[-1][0] > value:
                            window.pop()
                        window.append((value, pushed))
                    pushed += 1
                while window and window[0][1] < s + m:
                    window.popleft()
                if window:
                    here[s] = window[0][0] - score[s]
        if tables[0][i] == inf:
            return None
        sizes, s = [], i
        for t in range(p):
            cap_t = cap - sums[t] + self.eps
            after, target = tables[t + 1], tables[t][s]
            for e in range(s + m, n + 1):
                if (
                    allowed[e]
                    and after[e] < inf
                    and P[e] <= P[s] + cap_t
                    and self.moves(base + t, s, e) + after[e] == target
                ):
                    sizes.append(e - s)
                    s = e
                    break
            else:  # pragma: no cover - the table guarantees an end
                raise AssertionError("last round: lost the reconstruction")
        return int(tables[0][i]), tuple(sizes)

    # ---- phase 1: the smallest bottleneck

    def even_guess(self) -> tuple[float, list[int]] | None:
        """Megatron's even split, when it is allowed, as the first incumbent."""
        sizes = StageLayout.even(self.n, self.p, self.v).stage_sizes
        ends = list(itertools.accumulate(sizes))
        if min(sizes) < self.m or not all(self.allowed[e] for e in ends):
            return None
        return self.bottleneck_of(ends), ends

    def min_bottleneck(self) -> tuple[float, list[int] | None, float, bool]:
        """(bottleneck, ends, lower bound, proven); ends is None when no split satisfies the
        constraints (then proven is True).

        ``v == 2``: the pair-state dynamic program. Otherwise a branch and bound over the blocks
        before the last round, run as up to two dives that differ only in which block size they
        try first: sizes that keep the rank on course for an even finish, then the largest
        sizes first (which finds the lopsided optima where, e.g., a whole round sits in the
        compute layers). Either dive proves optimality if it finishes; both stop at once when
        the incumbent meets the lower bound.
        """
        floor = self.lower_bound()
        best = [math.inf, None]
        guess = self.even_guess()
        if guess is not None:
            best = list(guess)
        full_budget = budget = self.search_budget
        proven = False
        if self.v == 2:
            try:
                self.two_round_min_bottleneck(best, floor)
                proven = True
            except _SearchBudgetExceeded:
                pass
            budget = 0
        for order, share in (("even", 0.5), ("largest", 1.0)):
            if proven or budget <= 0:
                break
            if best[0] <= floor + self.tol:
                proven = True
                break
            self.nodes, self.search_budget = 0, max(1, int(budget * share))
            try:
                self._dive(order, floor, best)
                proven = True
                break
            except _SearchFinished:
                proven = True
                break
            except _SearchBudgetExceeded:
                budget -= self.nodes
        self.search_budget = full_budget
        if best[1] is None:
            return math.inf, None, floor, proven
        return best[0], best[1], min(floor, best[0]), proven

    def _dive(self, order: str, floor: float, best: list):
        """One branch and bound, improving ``best = [bottleneck, ends]`` in place; raises
        :class:`_SearchFinished` when it meets ``floor``."""
        p, v, n, m, P, allowed = self.p, self.v, self.n, self.m, self.P, self.allowed
        last_round = p * (v - 1)
        seen: set[tuple] = set()
        charge = 2 + p

        def visit(k: int, i: int, sums: list[float], ends: list[int]):
            if best[0] <= floor + self.tol:
                raise _SearchFinished
            bound = best[0] - self.tol
            self.tick()
            key = self.key(k, i, sums)
            if key in seen:
                return
            seen.add(key)
            if k == last_round:
                found = self.best_last_round(i, sums, bound, floor)
                if found is not None and found[0] < best[0]:
                    best[0], best[1] = found[0], ends + found[1]
                return
            self.tick(charge)
            if not self.fits(k, i, sums, bound):
                return
            r = k % p
            end_min, end_max = i + m, n - m * (self.num_stages - k - 1)
            room = bound - sums[r] + self.eps
            end_max = min(end_max, bisect.bisect_right(P, P[i] + room, i, end_max + 1) - 1)
            candidates = [e for e in range(end_min, end_max + 1) if allowed[e]]
            if order == "even":
                # Keep rank r on course for the water level, spread over its blocks to come.
                level = self.water_level(sums, P[n] - P[i])
                want = (level - sums[r]) / (v - k // p)
                candidates.sort(key=lambda e: (abs(P[e] - P[i] - want), e))
            else:
                candidates.reverse()
            for e in candidates:
                added = sums[r] + P[e] - P[i]
                if added > best[0] - self.tol + self.eps:
                    continue
                child = list(sums)
                child[r] = added
                ends.append(e)
                visit(k + 1, e, child, ends)
                ends.pop()

        visit(0, 0, list(self.offsets), [])

    # ---- two rounds (v == 2): an exact dynamic program over ranks

    # With v == 2, rank r holds block r of round 0, [x_{r-1}, x_r), and block r of round 1,
    # [y_{r-1}, y_r), where round 0 ends at R (x_{-1} = 0, x_{p-1} = y_{-1} = R, y_{p-1} = n).
    # Rank r's cost depends only on the pairs (x_{r-1}, y_{r-1}) and (x_r, y_r), so for each R
    # the ranks form a chain over pair states: a dynamic program, polynomial and exact, instead
    # of a search over every rank's running cost.

    def _round_ends(self) -> list[int]:
        """Candidate ends of round 0, those nearest half the decoder cost first."""
        n, p, m, P = self.n, self.p, self.m, self.P
        ends = [b for b in range(p * m, n - p * m + 1) if self.allowed[b]]
        ends.sort(key=lambda b: (abs(2 * P[b] - P[n]), b))
        return ends

    def _pair_steps(self, r, x, y, split, bound):
        """Pairs (x2, y2, load) rank r can reach from (x, y) with its load <= bound, given
        round 0 ends at ``split``, leaving no more than the later ranks can take; loads include
        the rank's embedding/output cost."""
        n, p, m, P, allowed = self.n, self.p, self.m, self.P, self.allowed
        offset = self.offsets[r]
        limit = bound + self.eps
        if r == p - 1:
            load = offset + P[split] - P[x] + P[n] - P[y]
            ok = split >= x + m and n >= y + m and load <= limit
            return [(split, n, load)] if ok else []
        # Later ranks can take at most `room` in all: both rounds' remainders must fit in it.
        room = sum(bound - self.offsets[q] for q in range(r + 1, p)) + p * self.eps
        x_last, y_last = split - m * (p - 1 - r), n - m * (p - 1 - r)
        steps = []
        for x2 in range(x + m, x_last + 1):
            base = offset + P[x2] - P[x]
            if base > limit:
                break
            if not allowed[x2]:
                continue
            # y2 at least where the remainder P[split]-P[x2] + P[n]-P[y2] fits in `room`.
            need = P[split] - P[x2] + P[n] - room
            y2 = max(y + m, bisect.bisect_left(P, need, y, y_last + 1) if need > P[y] else y + m)
            while y2 <= y_last:
                load = base + P[y2] - P[y]
                if load > limit:
                    break
                if allowed[y2]:
                    steps.append((x2, y2, load))
                y2 += 1
        return steps

    def two_round_min_bottleneck(self, best: list, floor: float) -> None:
        """Improve ``best = [bottleneck, ends]`` to the optimum (exact); nothing is below
        ``floor``."""
        p, n = self.p, self.n
        inf = math.inf
        for split in self._round_ends():
            if best[0] <= floor + self.tol:
                return
            bound = best[0] - self.tol if best[0] < inf else inf
            frontier: dict[tuple[int, int], float] = {(0, split): -inf}
            parents: list[dict] = []
            for r in range(p):
                reached: dict[tuple[int, int], float] = {}
                parent: dict[tuple[int, int], tuple[int, int]] = {}
                for state, worst in frontier.items():
                    steps = self._pair_steps(r, *state, split, bound)
                    self.tick(1 + len(steps) // 4)
                    for x2, y2, load in steps:
                        value = max(worst, load)
                        if value < reached.get((x2, y2), inf):
                            reached[(x2, y2)] = value
                            parent[(x2, y2)] = state
                parents.append(parent)
                frontier = reached
                if not frontier:
                    break
            final = frontier.get((split, n))
            if final is not None and final < best[0]:
                pairs, state = [], (split, n)
                for r in range(p - 1, -1, -1):
                    pairs.append(state)
                    state = parents[r][state]
                pairs.reverse()
                best[0], best[1] = final, [x for x, _ in pairs] + [y for _, y in pairs]

    def two_round_min_moves(self, cap: float) -> tuple[int, tuple[int, ...]] | None:
        """Fewest moves score over two-round splits with every rank <= ``cap``, then the
        canonical order; returns (score, ends) or None."""
        p, n = self.p, self.n
        inf = math.inf
        best = None
        # Layers between this split and an anchor's change rounds, so they move whatever else
        # happens: visit splits by that bound and stop once it exceeds the best score.
        def bound(split):
            return sum(weight * abs(split - ends[p - 1]) for weight, ends in self.anchor_ends)

        for split in sorted(self._round_ends(), key=lambda split: (bound(split), split)):
            if best is not None and bound(split) > best[0]:
                break
            # Forward: reachable pair states per rank.
            layers = [{(0, split)}]
            for r in range(p):
                reached = set()
                for x, y in layers[-1]:
                    steps = self._pair_steps(r, x, y, split, cap)
                    self.tick(1 + len(steps) // 4)
                    reached.update((x2, y2) for x2, y2, _ in steps)
                layers.append(reached)
                if not reached:
                    break
            if (split, n) not in layers[-1] or len(layers) != p + 1:
                continue
            # Backward: fewest moves from each state to the end.
            togo = {(split, n): 0}
            choices: list[dict] = [dict() for _ in range(p)]
            for r in range(p - 1, -1, -1):
                here: dict[tuple[int, int], float] = {}
                for x, y in layers[r]:
                    steps = self._pair_steps(r, x, y, split, cap)
                    self.tick(1 + len(steps) // 4)
                    best_here, options = inf, []
                    for x2, y2, _ in steps:
                        rest = togo.get((x2, y2))
                        if rest is None:
                            continue
                        score = self.moves(r, x, x2) + self.moves(p + r, y, y2) + rest
                        if score < best_here:
                            best_here, options = score, [(x2, y2)]
                        elif score == best_here:
                            options.append((x2, y2))
                    if options:
                        here[(x, y)] = best_here
                        choices[r][(x, y)] = min(options)  # canonical: smallest ends first
                togo = here
            score = togo.get((0, split))
            if score is None:
                continue
            state, ends = (0, split), []
            for r in range(p):
                state = choices[r][state]
                ends.append(state)
            key = (score, tuple(end for pair in ends for end in pair))
            if best is None or key < best:
                best = key
        if best is None:
            return None
        pairs = best[1]
        return best[0], tuple(pairs[0::2]) + tuple(pairs[1::2])

    # ---- phase 2: smallest moves score, then smallest sizes, among splits with ranks <= cap

    def canonical(self, k: int, ends: Sequence[int]) -> tuple[int, ...]:
        """The final tie-break key of the ends of stages ``k ..``: listed rank by rank (each
        rank's chunks in order), smaller first."""
        return tuple(ends[j - k] for j in self.rank_major[k])

    def min_moves(self, cap: float, fallback_ends: list[int]) -> tuple[tuple[int, ...], bool]:
        """(ends, proven): the tie-break winner among splits with every rank <= ``cap``:
        smallest moves score, then smallest :meth:`canonical` key."""
        p, v, n, m, P, allowed = self.p, self.v, self.n, self.m, self.P, self.allowed
        fallback_score, start = 0, 0
        for k, e in enumerate(fallback_ends):
            fallback_score += self.moves(k, start, e)
            start = e
        fallback = (fallback_score, self.canonical(0, fallback_ends), tuple(fallback_ends))
        if fallback_score == 0:  # it is every anchor itself: nothing else scores 0
            return fallback[2], True
        if v == 2:
            try:
                result = self.two_round_min_moves(cap)
            except _SearchBudgetExceeded:
                return fallback[2], False
            if result is None:  # pragma: no cover - the fallback itself qualifies
                return fallback[2], False
            return result[1], True

        last_round = p * (v - 1)
        best = [fallback]  # best complete split seen, for running out of budget
        charge = 1 + p // 2
        memo: dict[tuple, tuple] = {}

        def note(score, prefix, completion):
            ends = prefix + completion
            entry = (score, self.canonical(0, ends), ends)
            if entry < best[0]:
                best[0] = entry

        def solve(k, i, sums, allowance, moved, prefix):
            """Best (score, ends of stages k..) completion with score <= allowance, or None."""
            self.tick(charge)
            key = self.key(k, i, sums)
            known = memo.get(key)
            if known is not None:
                if known[0] == "exact":
                    if known[1] > allowance:
                        return None
                    note(moved + known[1], prefix, known[2])
                    return known[1], known[2]
                if known[1] > allowance:
                    return None
            closed = self.closed_moves(k, i)
            if closed > allowance:
                memo[key] = ("atleast", closed)
                return None
            if k == last_round:
                result = self.last_round_min_moves(i, sums, cap)
                if result is None:
                    memo[key] = ("atleast", math.inf)
                    return None
                completion = tuple(itertools.accumulate(result[1], initial=i))[1:]
                memo[key] = ("exact", result[0], completion)
                if result[0] > allowance:
                    return None
                note(moved + result[0], prefix, completion)
                return result[0], completion
            if not self.fits(k, i, sums, cap):
                memo[key] = ("atleast", math.inf)
                return None
            r = k % p
            end_min, end_max = i + m, n - m * (self.num_stages - k - 1)
            room = cap - sums[r] + self.eps
            end_max = min(end_max, bisect.bisect_right(P, P[i] + room, i, end_max + 1) - 1)
            # Blocks that move least first (finds good splits early); ties are settled by
            # comparing keys, so a later candidate may still win with an equal score.
            candidates = [(self.moves(k, i, e), e) for e in range(end_min, end_max + 1) if allowed[e]]
            candidates.sort()
            found = None  # (score, canonical key, completion)
            for step, e in candidates:
                limit = allowance if found is None else found[0]
                if step > limit:
                    break
                child = list(sums)
                child[r] += P[e] - P[i]
                sub = solve(k + 1, e, child, limit - step, moved + step, prefix + (e,))
                if sub is not None:
                    completion = (e,) + sub[1]
                    entry = (step + sub[0], self.canonical(k, completion), completion)
                    if found is None or entry < found:
                        found = entry
            if found is None:
                memo[key] = ("atleast", allowance + 1)
                return None
            memo[key] = ("exact", found[0], found[2])
            return found[0], found[2]

        proven = True
        try:
            solve(0, 0, list(self.offsets), fallback_score, 0, ())
        except _SearchBudgetExceeded:
            proven = False
        return best[0][2], proven


# --------------------------------------------------------------------------------------------
# Public planning API


def plan_layout(
    costs: Sequence[float],
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int = 1,
    *,
    embedding_cost: float = 0.0,
    output_cost: float = 0.0,
    current: StageLayout | None = None,
    min_layers_per_stage: int = 1,
    keep_together: Iterable[tuple[int, int]] = (),
    search_budget: int = DEFAULT_SEARCH_BUDGET,
) -> StageLayout:
    """The split of decoder layers over ``p`` ranks x ``v`` chunks with the cheapest slowest rank.

    Args:
        costs: cost of each decoder layer, in layer order (see ``cost_model``).
        pipeline_parallel_size: ``p``, pipeline ranks (``--pp``).
        virtual_pipeline_parallel_size: ``v``, model chunks per rank (``--vpp``).
        embedding_cost: charged to virtual stage 0 (pipeline rank 0, chunk 0).
        output_cost: output layer + loss, charged to the last chunk of the last rank.
        current: the layout in use; among equally fast splits the one moving the fewest layers
            away from it wins.
        min_layers_per_stage: decoder layers every virtual stage must hold. Megatron-Core accepts
            empty stages (0), e.g. a last stage holding only the loss; the default keeps one.
        keep_together: inclusive ``(first, last)`` layer spans that must share a virtual stage
            (e.g. a Q/K source and its sharing layers, whose carrier does not cross stages).
        search_budget: work units per search phase (see :data:`DEFAULT_SEARCH_BUDGET`); past
            it the best layout found is returned with ``optimal=False`` or
            ``ties_resolved=False``.

    Ties: bottlenecks within 1e-9 of the total cost are equal; then fewer moved layers; then
    the lexicographically smallest stage sizes.
    """
    p, v = pipeline_parallel_size, virtual_pipeline_parallel_size
    costs = [float(cost) for cost in costs]
    n = len(costs)
    _check_shape(n, p, v, min_layers_per_stage)
    for index, cost in enumerate(costs + [embedding_cost, output_cost]):
        if not math.isfinite(cost) or cost < 0:
            what = f"layer {index}" if index < n else ("embedding" if index == n else "output")
            raise ValueError(f"plan_layout: cost of {what} must be finite and >= 0, got {cost!r}")
    if current is not None and (
        current.num_layers != n
        or current.pipeline_parallel_size != p
        or current.virtual_pipeline_parallel_size != v
    ):
        raise ConfigError(
            f"the current layout (--pipeline-layout) has {current.num_layers} layers over "
            f"{current.pipeline_parallel_size} x {current.virtual_pipeline_parallel_size} "
            f"stages, but the plan is for {n} layers over --pp {p} x --vpp {v}"
        )
    allowed = [True] * (n + 1)
    spans = sorted(set(tuple(span) for span in keep_together))
    for first, last in spans:
        if not 0 <= first <= last < n:
            raise ValueError(f"plan_layout: keep_together span ({first}, {last}) outside 0..{n - 1}")
        for position in range(first + 1, last + 1):
            allowed[position] = False

    search = _Search(
        costs, p, v, embedding_cost, output_cost, min_layers_per_stage, allowed, current, search_budget
    )
    bottleneck, ends, lower_bound, proven = search.min_bottleneck()
    if ends is None:
        if not proven:
            raise ConfigError(
                f"the planner's search budget ({search_budget} units) ran out before it found any "
                f"split of {n} layers over --pp {p} x --vpp {v} keeping the spans {spans} "
                "together; raise search_budget or give a --pipeline-layout by hand"
            )
        raise ConfigError(
            f"no split of {n} decoder layers into --pp {p} x --vpp {v} = {p * v} virtual stages "
            f"with at least {min_layers_per_stage} layer(s) each keeps the spans {spans} "
            "within one stage; lower --pp/--vpp or give a --pipeline-layout by hand"
        )
    search.nodes = 0
    best_ends, ties_resolved = search.min_moves(bottleneck + search.tol, ends)
    sizes = search.ends_to_sizes(best_ends)
    layout = StageLayout.from_sizes(sizes, p, v, costs, embedding_cost, output_cost)
    return dataclasses.replace(
        layout,
        moved_layers=0 if current is None else layout.moves_from(current),
        optimal=proven,
        ties_resolved=ties_resolved,
        bottleneck_lower_bound=layout.bottleneck if proven else lower_bound,
    )


def _check_shape(num_layers: int, p: int, v: int, min_layers_per_stage: int):
    if not isinstance(p, int) or p < 1:
        raise ConfigError(f"--pp must be an integer >= 1, got {p!r}")
    if not isinstance(v, int) or v < 1:
        raise ConfigError(f"--vpp must be an integer >= 1, got {v!r}")
    if v > 1 and p == 1:
        raise ConfigError(
            f"--vpp {v} needs --pp > 1: the interleaved schedule splits model chunks over "
            "pipeline ranks (Megatron asks for --pp > 2 unless p2p overlap is on)"
        )
    if num_layers < 1:
        raise ConfigError(f"--num-layers must be >= 1, got {num_layers}")
    if min_layers_per_stage < 0:
        raise ValueError(f"min_layers_per_stage must be >= 0, got {min_layers_per_stage}")
    if p * v * min_layers_per_stage > num_layers:
        raise ConfigError(
            f"--pp {p} x --vpp {v} = {p * v} virtual pipeline stages need at least "
            f"{p * v * min_layers_per_stage} decoder layers ({min_layers_per_stage} per stage), "
            f"but the model has {num_layers}; lower --pp or --vpp, or allow empty stages in "
            "--pipeline-layout"
        )


def sharing_spans(num_layers: int, sharing_layers: Iterable[int]) -> list[tuple[int, int]]:
    """Spans ``(source, last_sharer)`` for a set of sharing layers, assuming each run of
    consecutive sharing layers takes its Q/K from the nearest non-sharing layer before it.

    Pass them as ``keep_together`` when the Q/K carrier cannot cross pipeline stages.
    """
    share = sorted(set(sharing_layers))
    if share and (share[0] < 1 or share[-1] >= num_layers):
        raise ValueError(
            f"sharing layers must lie in 1..{num_layers - 1} (layer 0 has no source), got {share}"
        )
    spans: list[tuple[int, int]] = []
    for layer in share:
        if spans and spans[-1][1] == layer - 1:
            spans[-1] = (spans[-1][0], layer)
        else:
            spans.append((layer - 1, layer))
    return spans


def _modes(num_layers: int, sharing_layers: Iterable[int]) -> list[str]:
    """Per-layer modes: the sharing layers, the source before each run of them, compute."""
    share = set(sharing_layers)
    if any(not 0 <= layer < num_layers for layer in share):
        raise ValueError(f"sharing layers {sorted(share)} outside 0..{num_layers - 1}")
    if 0 in share:
        raise ValueError("layer 0 cannot share: no source layer precedes it")
    modes = ["share" if layer in share else "compute" for layer in range(num_layers)]
    for layer in range(1, num_layers):
        if modes[layer] == "share" and modes[layer - 1] == "compute":
            modes[layer - 1] = "source"
    return modes


def plan_schedule(
    layer_costs: LayerCosts,
    num_layers: int,
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int = 1,
    sharing_sets: Sequence[tuple[int, Iterable[int]]] = (),
    *,
    current: StageLayout | None = None,
    min_layers_per_stage: int = 1,
    keep_sources_together: bool = False,
    search_budget: int = DEFAULT_SEARCH_BUDGET,
) -> list[tuple[int, StageLayout]]:
    """The layout to switch to at each step of an EPAS schedule.

    ``sharing_sets`` lists ``(iteration, sharing layer indices)`` in increasing iteration order,
    each the complete set of layers in sharing mode from that iteration on (include
    ``(0, [])`` to plan the starting layout). Each layout breaks ties toward the previous one
    (the first toward ``current``). With ``keep_sources_together`` every run of sharing layers
    stays in one virtual stage with its source (see :func:`sharing_spans`).
    """
    plan: list[tuple[int, StageLayout]] = []
    previous, last_iteration = current, None
    for iteration, sharing in sharing_sets:
        if last_iteration is not None and iteration <= last_iteration:
            raise ValueError(
                f"plan_schedule: iterations must increase, got {iteration} after {last_iteration}"
            )
        sharing = sorted(set(sharing))
        layout = plan_layout(
            costs_for_modes(layer_costs, _modes(num_layers, sharing)),
            pipeline_parallel_size,
            virtual_pipeline_parallel_size,
            embedding_cost=layer_costs.embedding,
            output_cost=layer_costs.output_layer,
            current=previous,
            min_layers_per_stage=min_layers_per_stage,
            keep_together=sharing_spans(num_layers, sharing) if keep_sources_together else (),
            search_budget=search_budget,
        )
        plan.append((iteration, layout))
        previous, last_iteration = layout, iteration
    return plan


def _ranges_text(layout: StageLayout, pp_rank: int) -> str:
    parts = []
    for vp in range(layout.virtual_pipeline_parallel_size):
        ids = layout.layer_range(pp_rank, vp)
        if len(ids) == 0:
            parts.append("-")
        elif len(ids) == 1:
            parts.append(f"{ids.start}")
        else:
            parts.append(f"{ids.start}-{ids.stop - 1}")
    return ",".join(parts)


def format_plan(
    layer_costs: LayerCosts,
    num_layers: int,
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int = 1,
    sharing_sets: Sequence[tuple[int, Iterable[int]]] = (),
    plan: Sequence[tuple[int, StageLayout]] | None = None,
    **plan_options,
) -> str:
    """A readable table of a schedule's layouts (computed with :func:`plan_schedule` and
    ``plan_options`` unless ``plan`` is given).

    Per switch: the layers each rank holds (``a-b`` per chunk, chunks separated by commas), its
    predicted cost under the rebalanced layout and under the fixed even split, the bottlenecks,
    and the speedups over the baseline (no sharing, even split): ``fixed`` keeps the even split,
    ``rebal`` switches to the planned layout. Speedup = baseline bottleneck / bottleneck (see
    :func:`predict_pipeline_speedup`).
    """
    p, v = pipeline_parallel_size, virtual_pipeline_parallel_size
    sharing_sets = [(iteration, sorted(set(sharing))) for iteration, sharing in sharing_sets]
    if plan is None:
        plan = plan_schedule(layer_costs, num_layers, p, v, sharing_sets, **plan_options)
    if len(plan) != len(sharing_sets):
        raise ValueError("format_plan: plan and sharing_sets differ in length")
    baseline = StageLayout.even(
        num_layers,
        p,
        v,
        costs_for_modes(layer_costs, ["compute"] * num_layers),
        layer_costs.embedding,
        layer_costs.output_layer,
    ).bottleneck
    lines = [
        f"pipeline plan: {num_layers} layers, --pp {p} --vpp {v}; baseline (no sharing, even "
        f"split) bottleneck {baseline:.4g}"
    ]
    for (iteration, sharing), (plan_iteration, layout) in zip(sharing_sets, plan):
        if iteration != plan_iteration:
            raise ValueError("format_plan: plan and sharing_sets differ in iterations")
        costs = costs_for_modes(layer_costs, _modes(num_layers, sharing))
        fixed = StageLayout.even(
            num_layers, p, v, costs, layer_costs.embedding, layer_costs.output_layer
        )
        shared = _compress(sharing) if sharing else "none"
        flag = "" if layout.optimal else " (search budget hit: best found, not proven optimal)"
        lines.append("")
        lines.append(
            f"iteration {iteration}: {len(sharing)} sharing layers ({shared}); "
            f"{layout.moved_layers} layers move{flag}"
        )
        lines.append(f"  --pipeline-model-parallel-layout {layout.to_layout_string(compact=True)}")
        width = max(len(_ranges_text(layout, r)) for r in range(p))
        width = max(width, len("layers"))
        lines.append(f"  {'rank':>4}  {'layers':<{width}}  {'cost':>9}  {'even-split':>10}")
        for r in range(p):
            lines.append(
                f"  {r:>4}  {_ranges_text(layout, r):<{width}}  {layout.rank_costs[r]:>9.4g}  "
                f"{fixed.rank_costs[r]:>10.4g}"
            )
        lines.append(
            f"  bottleneck {layout.bottleneck:.4g} (even split {fixed.bottleneck:.4g}); "
            f"speedup vs baseline: rebal {baseline / layout.bottleneck:.3f}x, "
            f"fixed {baseline / fixed.bottleneck:.3f}x"
        )
    return "\n".join(lines)


def _compress(layers: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class PipelineSpeedup:
    """Predicted effect of an EPAS sharing region on pipeline throughput.

    Model: every microbatch passes every rank and the pipeline advances at its slowest rank, so
    iteration time is proportional to the bottleneck rank's cost times ``(microbatches + p - 1)``
    (1F1B; the interleaved schedule changes the factor, not the ratio). With ``p`` and the
    microbatch count unchanged the factor cancels: a speedup is a ratio of bottlenecks. Costs
    of the pipeline's p2p transfers and of the bubble's imbalance are ignored.
    """

    baseline_bottleneck: float
    """No sharing, Megatron's even split (what runs without EPAS)."""

    baseline_rebalanced_bottleneck: float
    """No sharing, planned split (rebalancing alone, e.g. for embedding/output costs)."""

    fixed_bottleneck: float
    """Sharing region on, even split kept."""

    rebalanced_bottleneck: float
    """Sharing region on, planned split."""

    ideal_speedup: float
    """Total-cost ratio (no sharing / sharing): the speedup if both pipelines were perfectly
    balanced, as on a single device."""

    @property
    def speedup_without_rebalancing(self) -> float:
        return self.baseline_bottleneck / self.fixed_bottleneck

    @property
    def speedup_with_rebalancing(self) -> float:
        return self.baseline_bottleneck / self.rebalanced_bottleneck

    @property
    def speedup_over_rebalanced_baseline(self) -> float:
        """EPAS's own share of the gain: both sides rebalanced."""
        return self.baseline_rebalanced_bottleneck / self.rebalanced_bottleneck


def predict_pipeline_speedup(
    layer_costs: LayerCosts,
    num_layers: int,
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int = 1,
    region_size: int = 0,
    *,
    min_layers_per_stage: int = 1,
    keep_sources_together: bool = False,
    search_budget: int = DEFAULT_SEARCH_BUDGET,
) -> PipelineSpeedup:
    """Predicted pipeline throughput gain of EPAS with its deepest ``region_size`` layers in
    sharing mode (their source is the layer just before the region), with and without
    rebalancing the stages; see :class:`PipelineSpeedup` for the model."""
    p, v = pipeline_parallel_size, virtual_pipeline_parallel_size
    if not 0 <= region_size < num_layers:
        raise ConfigError(
            f"sharing region size must be in 0..{num_layers - 1} (a source layer must precede "
            f"it), got {region_size}"
        )
    sharing = range(num_layers - region_size, num_layers)
    options = dict(
        min_layers_per_stage=min_layers_per_stage,
        search_budget=search_budget,
        embedding_cost=layer_costs.embedding,
        output_cost=layer_costs.output_layer,
    )
    plain = costs_for_modes(layer_costs, ["compute"] * num_layers)
    shared = costs_for_modes(layer_costs, _modes(num_layers, sharing))
    even_kwargs = dict(embedding_cost=layer_costs.embedding, output_cost=layer_costs.output_layer)
    spans = sharing_spans(num_layers, sharing) if keep_sources_together else ()
    return PipelineSpeedup(
        baseline_bottleneck=StageLayout.even(num_layers, p, v, plain, **even_kwargs).bottleneck,
        baseline_rebalanced_bottleneck=plan_layout(plain, p, v, **options).bottleneck,
        fixed_bottleneck=StageLayout.even(num_layers, p, v, shared, **even_kwargs).bottleneck,
        rebalanced_bottleneck=plan_layout(shared, p, v, keep_together=spans, **options).bottleneck,
        ideal_speedup=(math.fsum(plain) + layer_costs.embedding + layer_costs.output_layer)
        / (math.fsum(shared) + layer_costs.embedding + layer_costs.output_layer),
    )
