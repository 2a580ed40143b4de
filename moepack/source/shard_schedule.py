"""The order in which to fetch a checkpoint's shards and run the jobs that read them.

Each job (pack a layer, stage a shard's dense tensors) names the shards it reads. Shards are fetched one at a time
in ``order``; after each fetch every job whose shards are all on disk runs, then (when dropping) every shard no job
left needs is dropped. So each shard is fetched at most once, and the source bytes on disk at any moment are the
shards "in flight": fetched, with jobs still waiting for them. Pure bookkeeping, no I/O: the same plan gives the
disk space check its figure before anything is downloaded.

Worked example: layers 0 and 1 in shard a, layer 2 split over b and c, sizes a=4, b=2, c=3:
fetch a -> run layer 0, 1 -> drop a; fetch b -> nothing runs (layer 2 also needs c); fetch c -> run layer 2 ->
drop b, c. On disk while jobs run: 4, 2, 5: the peak is 5, not 9.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable


@dataclass(frozen=True)
class Step:
    """Fetch ``fetch`` (None: nothing to fetch), run ``run`` in order, then drop ``drop``."""

    fetch: str | None
    run: tuple
    drop: tuple
    on_disk: int  # source bytes on disk while ``run`` runs (after the fetch, before the drops)
    fetched_on_disk: int  # the part of ``on_disk`` this plan fetched (not on disk when it started)


def plan_shard_steps(needs: dict[Hashable, Iterable[str]], order: list[str], sizes: dict[str, int],
                     present: Iterable[str] = (), drop: bool = True) -> list[Step]:
    """Steps that run every job of ``needs`` (job -> shards it reads; jobs run in the dict's order when several
    become ready together). ``present``: shards already on disk (never fetched; dropped when ``drop`` and no job
    needs them). Without ``drop`` nothing is dropped and every needed shard stays."""
    pending = {job: frozenset(shards) for job, shards in needs.items()}
    wanted = frozenset().union(*pending.values()) if pending else frozenset()
    unknown = wanted - set(order)
    if unknown:
        raise ValueError(f"jobs read shards that are not in the order: {sorted(unknown)}")
    have = [s for s in order if s in set(present)]
    started = set(have)
    steps: list[Step] = []

    def step(fetch: str | None) -> None:
        ready = [job for job, shards in pending.items() if shards <= set(have)]
        for job in ready:
            del pending[job]
        still = frozenset().union(*pending.values()) if pending else frozenset()
        gone = tuple(s for s in have if s not in still) if drop else ()
        on_disk = sum(sizes[s] for s in have)
        fetched = sum(sizes[s] for s in have if s not in started)
        steps.append(Step(fetch, tuple(ready), gone, on_disk, fetched))
        for s in gone:
            have.remove(s)

    step(None)
    for shard in order:
        if shard in wanted and shard not in have and shard not in started:
            have.append(shard)
            step(shard)
    assert not pending, pending  # every shard a job reads was fetched
    return steps


def peak_on_disk(steps: list[Step]) -> tuple[int, int]:
    """(most source bytes on disk at once, most of them fetched by the plan) over ``steps``."""
    return max((s.on_disk for s in steps), default=0), max((s.fetched_on_disk for s in steps), default=0)
