"""The search behind :func:`~epas_megatron.parallel.balancer.balance_layout`: the split of the
decoder layers into virtual pipeline stages whose slowest pipeline rank is cheapest.

The problem in the terms used here: layers ``0 .. n-1``, ``prefix[i]`` the cost of layers
``0 .. i-1``; ``K = p * v`` virtual stages, stage ``k`` held by rank ``k % p``, each holding at
least one layer. A split is given by the end of every stage, ``ends[k]`` (position ``e`` is the
gap just before layer ``e``; ``ends[K-1] = n``). Stage ``k`` also carries a fixed cost
``offsets[k]`` (embedding, output layer, its pipeline boundaries' traffic), and a stage may end at
``e`` only where ``allowed[e]``. A rank's cost is the sum of its stages'; the *bottleneck* is the
largest rank cost. :func:`best_split` looks for the split with the smallest bottleneck.

How: the stages come in ``v`` *rounds* of ``p`` (round ``c`` is chunk ``c`` of every rank:
stages ``c*p .. c*p + p-1``), each round a contiguous run of layers. For each choice of the round
ends, a dynamic program over the ranks ``0 .. p-1``: rank ``r`` takes one block from every round,
so after rank ``r`` the split so far is described by the ``v`` block ends of rank ``r`` (the DP
*state*), and rank ``r``'s cost depends only on its state and rank ``r-1``'s. With ``v = 1`` there
is one round and this is the classic linear-partition DP. A partial split is dropped when it
already costs more than the best complete one, or leaves more cost or more layers than the later
ranks can take under that bound.

Two passes over the same DP: the first finds the smallest bottleneck ``B``; the second, among the
splits with every rank within ``B + tol``, picks the one whose stage ends are nearest Megatron's
even split (smallest sum of ``|end - even end|``), then the smallest ends listed rank by rank
(fewer layers on early ranks, which under 1F1B hold the most in-flight activations). ``tol`` is
``1e-9`` of the total cost: bottlenecks that close count as equal.

Both passes are exact, but the round-end choices grow as ``n^(v-1)``: with 32 layers a split
takes well under a second for ``v <= 2`` and for ``p = 8`` up to ``v = 4``, but ``p <= 4`` with
``v >= 3`` can take several seconds. So each pass stops after :data:`WORK_BUDGET` counted
steps, trying round ends nearest the even split's first, and returns the best split found
(``proven`` False; on 7B-like shapes with ``p = 4, v = 4`` within 0.5% of the optimum). The
count is plain arithmetic on the inputs, never a clock: every rank searching the same inputs gets
the same split.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

REL_TOL = 1e-9
"""Bottlenecks within this fraction of the total cost count as equal."""

WORK_BUDGET = 300_000
"""Steps (partial blocks tried) per pass before :func:`best_split` settles for the best split
found: up to about half a second on one CPU core."""


def even_ends(num_layers: int, num_stages: int) -> list[int]:
    """Stage ends of Megatron's even split (the first ``num_layers % num_stages`` stages one
    layer longer), as :meth:`StageLayout.even <epas_megatron.parallel.layout.StageLayout.even>`."""
    base, extra = divmod(num_layers, num_stages)
    return list(itertools.accumulate(base + (k < extra) for k in range(num_stages)))


def bottleneck(
    prefix: Sequence[float], p: int, offsets: Sequence[float], ends: Sequence[int]
) -> float:
    """The largest rank cost of the split ``ends``."""
    ranks, start = [0.0] * p, 0
    for k, end in enumerate(ends):
        ranks[k % p] += offsets[k] + prefix[end] - prefix[start]
        start = end
    return max(ranks)


def best_split(
    prefix: Sequence[float],
    p: int,
    v: int,
    offsets: Sequence[float],
    allowed: Sequence[bool],
    work_budget: int = WORK_BUDGET,
    fits=None,
) -> tuple[list[int] | None, bool]:
    """``(ends, proven)``: the stage ends of the split with the smallest bottleneck (ties as in
    the module docstring), or None when no split with at least one layer per stage ends only
    where ``allowed``; ``proven`` is False when a pass ran out of ``work_budget``.

    ``fits(rank, starts, ends)``, if given, says whether a rank holding layers
    ``starts[c] .. ends[c] - 1`` of every round ``c`` is feasible (a memory budget): only
    splits whose every rank fits are considered."""
    n, num_stages = len(prefix) - 1, p * v
    even = even_ends(n, num_stages)

    def blocks_of(ends):  # blocks[r][c]: end of rank r's block in round c
        return tuple(tuple(ends[c * p + r] for c in range(v)) for r in range(p))

    def distance(blocks):
        return sum(abs(blocks[k % p][k // p] - even[k]) for k in range(num_stages))

    total = prefix[n] + math.fsum(offsets)
    search = _RankDP(prefix, p, offsets, allowed, REL_TOL * total, work_budget, fits)
    # Round ends nearest the even split's first (they are stage ends of the last rank, so this
    # is also a lower bound on a split's distance from the even split).
    rounds = sorted(
        (sum(abs(end - even[c * p + p - 1]) for c, end in enumerate(ends)), starts, ends)
        for starts, ends in _round_choices(n, p, v, allowed)
    )
    best = None  # (bottleneck, blocks)
    if n >= num_stages and all(allowed[end] for end in even) and _split_fits(even, p, v, fits):
        best = (bottleneck(prefix, p, offsets, even), blocks_of(even))
    proven = True
    try:  # pass 1: the smallest bottleneck
        for _, starts, ends in rounds:
            bound = best[0] - search.tol if best else math.inf
            best = search.run(starts, ends, bound, None, math.inf) or best
    except _OutOfWork:
        proven = False
    if best is None:
        return None, proven
    winner = (distance(best[1]), best[1])
    search.work = 0
    try:  # pass 2: the tie-break among splits within best + tol
        for least_distance, starts, ends in rounds:
            if least_distance > winner[0]:
                break
            found = search.run(starts, ends, best[0] + search.tol, even, winner[0])
            if found is not None and found < winner:
                winner = found
    except _OutOfWork:
        proven = False
    blocks = winner[1]
    return [blocks[k % p][k // p] for k in range(num_stages)], proven


def _split_fits(ends: Sequence[int], p: int, v: int, fits) -> bool:
    """Whether every rank of the split ``ends`` passes ``fits`` (always, without one)."""
    if fits is None:
        return True
    starts = [0, *ends[:-1]]
    return all(fits(r, tuple(starts[c * p + r] for c in range(v)), tuple(ends[c * p + r] for c in range(v))) for r in range(p))


def _round_choices(n: int, p: int, v: int, allowed: Sequence[bool]):
    """``(starts, ends)`` of the ``v`` rounds: every round at least ``p`` layers, ending only
    where allowed."""
    for inner in itertools.combinations(range(p, n - p + 1), v - 1):
        starts, ends = (0, *inner), (*inner, n)
        if all(e - s >= p for s, e in zip(starts, ends)) and all(allowed[e] for e in inner):
            yield starts, ends


class _OutOfWork(Exception):
    pass


class _RankDP:
    """The dynamic program over ranks for fixed round ends (see the module docstring)."""

    def __init__(self, prefix, p, offsets, allowed, tol, work_budget, fits=None):
        self.prefix, self.p, self.offsets, self.allowed, self.fits = prefix, p, offsets, allowed, fits
        self.tol, self.work, self.work_budget = tol, 0, work_budget
        layer_costs = sorted(b - a for a, b in zip(prefix, prefix[1:]))
        self.cheapest = [0.0, *itertools.accumulate(layer_costs)]  # cheapest[j]: j cheapest layers

    def run(self, starts, ends, bound, even, max_distance):
        """The best split for these round ends with every rank's cost at most ``bound``, as
        ``(score, blocks rank by rank)``, or None if there is none. Pass 1 (``even`` None):
        score = the bottleneck. Pass 2 (``even``: the even split's stage ends): score = the
        distance from the even split, at most ``max_distance``."""
        prefix, p, offsets, v = self.prefix, self.p, self.offsets, len(starts)
        frontier = {starts: (-math.inf if even is None else 0, ())}
        for r in range(p):
            last = r == p - 1
            own = math.fsum(offsets[c * p + r] for c in range(v))
            later_own = [math.fsum(offsets[c * p + q] for c in range(v)) for q in range(r + 1, p)]
            # What ranks r+1 .. p-1 can still take, in cost and in layers (the last rank takes
            # exactly the rest). Each layer costs at least the cheapest ones.
            room = (p - 1 - r) * bound - math.fsum(later_own) if not last else math.inf
            room_layers = sum(
                bisect.bisect_right(self.cheapest, bound - q_own + self.tol) - 1
                for q_own in later_own
            )
            tops = [end - (p - 1 - r) for end in ends]  # leave a layer per later rank and round
            reached = {}
            for state, (score, path) in frontier.items():
                lows = tops if last else [x + 1 for x in state]
                rest = math.fsum(prefix[end] - prefix[x] for end, x in zip(ends, state))
                need = own + rest - room  # this rank's least load leaving the rest <= room
                need_layers = sum(ends) - sum(state) - room_layers if not last else 0
                for blocks, load in self.blocks(state, lows, tops, own, bound, need, need_layers):
                    if self.fits is not None and not self.fits(r, state, blocks):
                        continue
                    if even is None:
                        new_score = max(score, load)
                    else:
                        moved = sum(abs(b - even[c * p + r]) for c, b in enumerate(blocks))
                        new_score = score + moved
                        if new_score > max_distance:
                            continue
                    new = (new_score, path + (blocks,))
                    old = reached.get(blocks)
                    if old is None or new < old:
                        reached[blocks] = new
            frontier = reached
            if not frontier:
                return None
        return frontier.get(ends)

    def blocks(self, state, lows, tops, own, bound, need, need_layers):
        """A rank's choices from ``state``: block ends ``lows[c] <= y[c] <= tops[c]`` (allowed)
        with ``need <= load <= bound`` and at least ``need_layers`` layers in all, where
        ``load = own + sum(prefix[y[c]] - prefix[state[c]])``; a list of ``(y, load)``."""
        prefix, allowed, v = self.prefix, self.allowed, len(state)
        most = [0.0] * (v + 1)  # most[c]: the largest load rounds c .. v-1 can add
        most_layers = [0] * (v + 1)  # and the most layers
        for c in range(v - 1, -1, -1):
            most[c] = most[c + 1] + max(0.0, prefix[tops[c]] - prefix[state[c]])
            most_layers[c] = most_layers[c + 1] + max(0, tops[c] - state[c])
        need -= self.tol  # rounding slack: this check only prunes
        found, chosen = [], []

        def extend(c: int, load: float, layers: int):
            self.work += 1
            if self.work > self.work_budget:
                raise _OutOfWork
            if c == v:
                found.append((tuple(chosen), load))
                return
            for end in range(lows[c], tops[c] + 1):
                total = load + prefix[end] - prefix[state[c]]
                if total > bound:
                    break
                taken = layers + end - state[c]
                if (
                    total + most[c + 1] < need
                    or taken + most_layers[c + 1] < need_layers
                    or not allowed[end]
                ):
                    continue
                chosen.append(end)
                extend(c + 1, total, taken)
                chosen.pop()

        extend(0, own, 0)
        return found
