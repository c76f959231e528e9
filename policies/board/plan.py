"""Pure planning for the board: which patches to write, which to apply, which versions to keep.

Squashed catch-up patches. Into each version ``v`` the publisher writes the delta from the
previous version and, for every level ``j = 1 … L``, a patch from ``b_j(v) = ((v-1) // 2**j) *
2**j`` — the newest multiple of ``2**j`` below ``v`` — when it still holds that view. For ``v`` a
multiple of ``2**j`` this is the aligned jump ``v - 2**j → v``; otherwise a jump from the last
``2**j`` boundary. With contiguous versions a reader ``k ≤ 2**L`` versions behind reaches any
target in at most ``floor(log2 k) + 1`` patches: it climbs from ``have`` by aligned jumps
(``c → c + lowbit(c)``, one per set bit of ``P - have``) to ``P``, the target with the bits below
the highest bit where ``have`` and the target differ cleared, then takes one jump ``P → want``.
The publisher keeps only the views at ``(v // 2**j) * 2**j`` (at most ``L + 1``).

:func:`plan` finds the route with the fewest patches (then fewest bytes) over the patches that
exist, and compares it with the cheapest route from an anchor; it takes whichever moves fewer
bytes. :func:`removable` says which versions retention may delete.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

from policies.board.types import CatchUp, Manifest, Step


def patch_bases(version: int, previous: int | None, held: Iterable[int], levels: int) -> list[int]:
    """The bases of the patches to write into ``version``, the previous version first."""
    have = set(held)
    out = [previous] if previous is not None and previous in have else []
    for j in range(1, levels + 1):
        b = ((version - 1) // (1 << j)) * (1 << j)
        if b >= 0 and b in have and b not in out:
            out.append(b)
    return out


def keep_views(version: int, held: Iterable[int], levels: int) -> set[int]:
    """Views a publisher must keep after publishing ``version`` (future bases), ⊆ held ∪ {v}."""
    marks = {(version // (1 << j)) * (1 << j) for j in range(levels + 1)}
    return marks & (set(held) | {version})


Cost = tuple[int, int]


def _shortest(
    starts: Mapping[int, tuple[Cost, Step | None]],
    edges: Mapping[int, list[Step]],
    want: int,
) -> tuple[Cost, int, list[Step]] | None:
    """Dijkstra on (hops, bytes) from several starts; (cost, start, steps) or None."""
    best: dict[int, Cost] = {}
    prev: dict[int, Step | None] = {}
    heap: list[tuple[Cost, int]] = []
    for node, (cost, step) in starts.items():
        best[node], prev[node] = cost, step
        heapq.heappush(heap, (cost, node))
    while heap:
        cost, node = heapq.heappop(heap)
        if cost != best.get(node) or node > want:
            continue
        if node == want:
            steps: list[Step] = []
            cur = node
            while (step := prev[cur]) is not None:
                steps.append(step)
                cur = step.base
            return cost, cur, steps[::-1]
        for step in edges.get(node, []):
            nxt = (cost[0] + 1, cost[1] + step.bytes)
            if step.version not in best or nxt < best[step.version]:
                best[step.version], prev[step.version] = nxt, step
                heapq.heappush(heap, (nxt, step.version))
    return None


def plan(manifests: Mapping[int, Manifest], have: int | None, want: int) -> CatchUp | None:
    """The cheapest way from ``have`` (None: nothing held) to ``want`` over ``manifests``.

    None if no route exists (no patch chain from ``have`` and no anchor at or before ``want``).
    """
    if have == want:
        return CatchUp(have=have, want=want, anchor=None, steps=[])
    edges: dict[int, list[Step]] = {}
    for m in manifests.values():
        for p in m.patches:
            step = Step(base=p.base, version=m.version, file=p.file, bytes=p.bytes)
            edges.setdefault(p.base, []).append(step)
    direct = None
    if have is not None and have < want:
        direct = _shortest({have: ((0, 0), None)}, edges, want)
    anchors = {v: ((1, m.bytes), None) for v, m in manifests.items() if m.kind == "anchor"}
    via = _shortest({v: c for v, c in anchors.items() if v <= want}, edges, want)
    if direct is not None and (via is None or direct[0][1] <= via[0][1]):
        return CatchUp(have=have, want=want, anchor=None, steps=direct[2])
    if via is None:
        return None
    start = via[1]
    return CatchUp(
        have=have,
        want=want,
        anchor=start,
        anchor_bytes=manifests[start].bytes,
        steps=via[2],
    )


def removable(kinds: Mapping[int, str], keep_from: int, latest: int | None) -> list[int]:
    """Versions retention may delete so that every version ≥ ``keep_from`` stays reachable.

    Kept: the newest anchor at or before ``keep_from`` (a fresh reader starts there) and every
    version after it, and always ``latest``. A reader holding ``h ≥ keep_from`` needs only
    patches stored in versions after ``h``, which are kept. Nothing is removed if no anchor is at
    or before ``keep_from``.
    """
    anchors = [v for v, k in kinds.items() if k == "anchor" and v <= keep_from]
    if not anchors:
        return []
    floor = max(anchors)
    return sorted(v for v in kinds if v < floor and v != latest)
