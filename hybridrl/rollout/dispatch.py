"""A partial rollout's requests spread over the run's engine replicas, each with its share of the groups to complete.

    outs = generate_partial(group, requests, groups, need, wait_for, step, params)   # one output per request

Groups go to the replicas in turn (group k to replica k mod R), so the oldest groups, which hold the carried
samples, spread over all replicas rather than crowd the first. Each replica stops once its own quota of groups is
complete (and the requests it must wait for have finished); the quotas, shared out in proportion to the replicas'
groups, add up to `need`. A request's random stream
is keyed by its prompt and sample index alone, so what it draws does not depend on which replica runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.phases import Phase
from hybridrl.rollout.generation import ReplicaShare
from hybridrl.workers.group import WorkerGroup


def quotas(sizes: Sequence[int], need: int) -> list[int]:
    """`need` shared out over parts of `sizes` groups in proportion to their size (largest remainder, ties to the
    earlier part); no part gets more than it has. `need` must not exceed sum(sizes)."""
    total = sum(sizes)
    if need > total:
        raise ValueError(f"cannot complete {need} groups out of {total}")
    if not total:
        return [0] * len(sizes)
    base = [need * s // total for s in sizes]
    order = sorted(range(len(sizes)), key=lambda r: (-(need * sizes[r] % total), r))
    left = need - sum(base)
    for r in order:
        if not left:
            break
        if base[r] < sizes[r]:
            base[r] += 1
            left -= 1
    return base


def generate_partial(
    group: WorkerGroup,
    requests: Sequence[GenerationRequest],
    groups: Sequence[int],
    need: int,
    wait_for: Sequence[int],
    step: int,
    params: SamplingParams,
) -> list[Any]:
    """The `Phase.GENERATE_PARTIAL` of every rank: completions (trajectories with rollout=agent) of `requests`, in
    order, once `need` of their groups (`groups[i]`: request i's group) are complete and the requests `wait_for`
    (indices) finished."""
    topo = group.topology
    leaders = topo.engine_leaders()
    order = list(dict.fromkeys(groups))  # each group once, in order of appearance
    replica_of = {g: k % len(leaders) for k, g in enumerate(order)}
    mine: list[list[int]] = [[] for _ in leaders]  # per replica, its requests' indices
    for i, g in enumerate(groups):
        mine[replica_of[g]].append(i)
    share = quotas([sum(1 for g in order if replica_of[g] == r) for r in range(len(leaders))], need)
    waits = set(wait_for)
    local_waits = [[k for k, i in enumerate(m) if i in waits] for m in mine]
    args = []
    for rank in range(topo.world_size):
        r = topo.of_rank(rank).engine_dp_rank
        reqs, grps = [requests[i] for i in mine[r]], [groups[i] for i in mine[r]]
        args.append((ReplicaShare(reqs, grps, share[r], local_waits[r]), step, params))
    results = group.run(Phase.GENERATE_PARTIAL, args)
    out: list[Any] = [None] * len(requests)
    for r, leader in enumerate(leaders):
        for i, o in zip(mine[r], results[leader], strict=True):
            out[i] = o
    return out
