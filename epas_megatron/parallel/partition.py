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

**V placement** (``placement="v"``; Qi et al., "Pipeline Parallelism with Controllable Memory",
NeurIPS 2024): ``K = 2p`` stages, stage ``k`` on rank ``k`` going down and on rank ``2p-1-k``
coming back up, so the second round visits the ranks in reverse. The same DP solves it: for a
*turn* ``m`` (the end of stage ``p-1``, the one round end) the gaps after the turn are read
backwards -- position ``x > m`` stands for gap ``n + m - x`` -- which makes the V split an
interleaved one with ``v = 2`` where rank ``r`` again takes one block from each round in rank
order. ``offsets`` and the returned ends are in V stage order; ``fits`` sees a rank's two chunks
in layer order. Ties as above in those terms: the distance is the sum over the V stage ends of
``|end - even end|`` (the even split :func:`even_ends`, which is
:func:`~epas_megatron.model.v_placement.even_v_stage_sizes`), then the smallest blocks rank by
rank, where a rank's second block is measured as ``m`` plus the second-round layers it and the
ranks before it hold (again: fewer layers on early ranks).
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
    layer longer), as :meth:`StageLayout.even <epas_megatron.model.stage_layout.StageLayout.even>`."""
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
    placement: str = "interleaved",
) -> tuple[list[int] | None, bool]:
    """``(ends, proven)``: the stage ends of the split with the smallest bottleneck (ties as in
    the module docstring), or None when no split with at least one layer per stage ends only
    where ``allowed``; ``proven`` is False when a pass ran out of ``work_budget``.

    ``fits(rank, starts, ends)``, if given, says whether a rank holding layers
    ``starts[c] .. ends[c] - 1`` of every round ``c`` is feasible (a memory budget): only
    splits whose every rank fits are considered.

    ``placement``: ``"interleaved"`` (stage ``k`` on rank ``k % p``) or ``"v"`` (V placement,
    ``v = 2``: stage ``k`` on rank ``k`` and ``2p-1-k``; ``offsets`` and the ends in V stage
    order; see the module docstring)."""
    if placement not in ("interleaved", "v"):
        raise ValueError(f"best_split: placement must be 'interleaved' or 'v', got {placement!r}")
    if placement == "v" and v != 2:
        raise ValueError(f"best_split: V placement has two chunks per rank, got v={v}")
    n, num_stages = len(prefix) - 1, p * v
    even = even_ends(n, num_stages)
    view_of = _mirrored_view if placement == "v" else _View

    def blocks_of(ends):  # blocks[r][c]: end of rank r's block in round c
        return tuple(tuple(ends[c * p + r] for c in range(v)) for r in range(p))

    def distance(view, blocks):
        return sum(abs(blocks[k % p][k // p] - view.even[k]) for k in range(num_stages))

    total = prefix[n] + math.fsum(offsets)
    search = _RankDP(prefix, p, REL_TOL * total, work_budget)
    # Round ends nearest the even split's first (they are stage ends of the last rank, so this
    # is also a lower bound on a split's distance from the even split).
    views = sorted(
        (view_of(prefix, p, offsets, allowed, fits, even, starts, ends)
         for starts, ends in _round_choices(n, p, v, allowed)),
        key=lambda view: (view.least_distance, view.starts, view.ends),
    )
    best = None  # (bottleneck, view, blocks)
    if n >= num_stages:
        round_ends = tuple(even[c * p + p - 1] for c in range(v))
        view = view_of(prefix, p, offsets, allowed, fits, even, (0, *round_ends[:-1]), round_ends)
        if all(view.allowed[end] for end in view.even) and _split_fits(view.even, p, v, view.fits):
            best = (bottleneck(view.prefix, p, view.offsets, view.even), view, blocks_of(view.even))
    proven = True
    try:  # pass 1: the smallest bottleneck
        for view in views:
            bound = best[0] - search.tol if best else math.inf
            found = search.run(view, bound, None, math.inf)
            if found is not None:
                best = (found[0], view, found[1])
    except _OutOfWork:
        proven = False
    if best is None:
        return None, proven
    limit = best[0] + search.tol
    winner = (distance(best[1], best[2]), best[2], best[1])  # (distance, blocks, view)
    search.work = 0
    try:  # pass 2: the tie-break among splits within best + tol
        for view in views:
            if view.least_distance > winner[0]:
                break
            found = search.run(view, limit, view.even, winner[0])
            if found is not None and found < winner[:2]:
                winner = (*found, view)
    except _OutOfWork:
        proven = False
    return winner[2].stage_ends(winner[1]), proven


class _View:
    """The search's problem for one choice of round ends, in the DP's terms (stage ``c*p + r``
    is rank ``r``'s block in round ``c``). Interleaved placement: the caller's terms unchanged."""

    def __init__(self, prefix, p, offsets, allowed, fits, even, starts, ends):
        self.prefix, self.p, self.offsets, self.allowed, self.fits = prefix, p, offsets, allowed, fits
        self.even, self.starts, self.ends = even, starts, ends
        self.least_distance = sum(abs(end - even[c * p + p - 1]) for c, end in enumerate(ends))

    def stage_ends(self, blocks) -> list[int]:
        """The caller's stage ends of the split whose blocks (rank by rank) are ``blocks``."""
        p, v = self.p, len(self.ends)
        return [blocks[k % p][k // p] for k in range(p * v)]


def _mirrored_view(prefix, p, offsets, allowed, fits, even, starts, ends) -> _View:
    """V placement with the turn at ``m = ends[0]`` as an interleaved problem: the gaps after the
    turn read backwards (position ``x > m`` is gap ``n + m - x``), so rank ``r``'s second-round
    block is the ``r``-th from the turn (see the module docstring)."""
    n, m = len(prefix) - 1, ends[0]
    back = lambda x: n + m - x  # noqa: E731 (a position after the turn <-> its gap)
    mirrored_prefix = [*prefix[: m + 1], *(prefix[n] + prefix[m] - prefix[back(x)] for x in range(m + 1, n + 1))]
    mirrored_allowed = [*allowed[: m + 1], *(allowed[back(x)] for x in range(m + 1, n + 1))]
    round_offsets = [*offsets[:p], *(offsets[2 * p - 1 - r] for r in range(p))]
    # Rank r's second-round block ends where V stage 2p-1-r starts: at the end of stage 2p-2-r.
    mirrored_even = [*even[:p], *(back(even[2 * p - 2 - r]) for r in range(p - 1)), n]
    mirrored_fits = None
    if fits is not None:
        def mirrored_fits(rank, block_starts, block_ends):
            return fits(rank, (block_starts[0], back(block_ends[1])), (block_ends[0], back(block_starts[1])))
    view = _View(mirrored_prefix, p, round_offsets, mirrored_allowed, mirrored_fits, mirrored_even, starts, ends)

    def stage_ends(blocks) -> list[int]:
        second_starts = [m, *(blocks[r][1] for r in range(p - 1))]  # rank r's second block starts here
        return [*(blocks[k][0] for k in range(p)), *(back(second_starts[2 * p - 1 - k]) for k in range(p, 2 * p))]

    view.stage_ends = stage_ends
    return view


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

    def __init__(self, prefix, p, tol, work_budget):
        self.p, self.tol, self.work, self.work_budget = p, tol, 0, work_budget
        # (the same layers in every view: mirroring reorders them)
        layer_costs = sorted(b - a for a, b in zip(prefix, prefix[1:]))
        self.cheapest = [0.0, *itertools.accumulate(layer_costs)]  # cheapest[j]: j cheapest layers

    def run(self, view, bound, even, max_distance):
        """The best split for the round ends of ``view`` (a :class:`_View`) with every rank's
        cost at most ``bound``, as ``(score, blocks rank by rank)``, or None if there is none.
        Pass 1 (``even`` None): score = the bottleneck. Pass 2 (``even``: the even split's stage
        ends in the view's terms): score = the distance from the even split, at most
        ``max_distance``."""
        prefix, p, offsets, starts, ends = view.prefix, self.p, view.offsets, view.starts, view.ends
        v = len(starts)
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
                for blocks, load in self.blocks(view, state, lows, tops, own, bound, need, need_layers):
                    if view.fits is not None and not view.fits(r, state, blocks):
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

    def blocks(self, view, state, lows, tops, own, bound, need, need_layers):
        """A rank's choices from ``state``: block ends ``lows[c] <= y[c] <= tops[c]`` (allowed)
        with ``need <= load <= bound`` and at least ``need_layers`` layers in all, where
        ``load = own + sum(prefix[y[c]] - prefix[state[c]])``; a list of ``(y, load)``."""
        prefix, allowed, v = view.prefix, view.allowed, len(state)
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
