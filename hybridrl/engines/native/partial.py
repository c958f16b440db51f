"""The fused engine's partial rollouts: generate a set of requests and stop as soon as enough groups are complete.

    outs = engine.generate_partial(requests, params, groups, need, wait_for)   # groups[i]: request i's group
    # every group counted complete has all its completions, every request of wait_for too; the rest come back
    # 'partial' with their tokens so far

The scheduler runs as for `generate_requests` (continuous batching: requests beyond the batch's rows join as rows
free up); after each step the finished requests count down their groups (`GroupCountdown`), and once `need` groups
are complete and the `wait_for` requests finished, `Scheduler.stop` reads what was already launched and hands back
every unfinished sequence as it is. Stopping only pays where something has a tail: if at that moment no unfinished
request has more of its cap left than any request has sampled (`has_tail`), the call runs on to the end instead,
each request in its own stream, so a rollout with no tail samples what `generate_requests` would, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridrl.engines.base import Completion, GenerationRequest, GroupCountdown, SamplingParams
from hybridrl.engines.native.base import check_requests
from hybridrl.engines.native.frozen_heap import frozen_heap
from hybridrl.engines.native.kv_cache import blocks_for
from hybridrl.engines.native.scheduler import Scheduler
from hybridrl.errors import HybridRLError


def has_tail(scheduler: Scheduler, longest: int) -> bool:
    """Whether some unfinished request's cap leaves more tokens than the `longest` any request has sampled so far (a
    waiting one counts its whole cap): only then does stopping save decode steps worth carrying a sample to the next
    weights. The rollout finishes the others after the stop (hybridrl/rollout/partial.py, the same rule)."""
    return any(s.finish is None and s.max_new - s.launched > longest for s in [*scheduler.rows, *scheduler.waiting])


class PartialGeneration:
    """`generate_partial` for `FusedEngine` (a mixin: it drives the engine's own scheduler)."""

    stops_early = True

    @torch.inference_mode()
    def generate_partial(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        groups: Sequence[object],
        need: int,
        wait_for: Sequence[int] = (),
    ) -> list[Completion]:
        """One completion per request, in order; stops after the first scheduler step at whose end `need` groups are
        complete, the requests `wait_for` finished and some request still has a tail (`RolloutEngine.generate_partial`;
        with no tail left it runs every request to its end). Every rank of an engine TP
        group sees the same completions, so all ranks stop at the same step."""
        self._check_awake("generate")
        check_requests(requests)
        scheduler = self.scheduler
        if scheduler.has_work:
            raise HybridRLError(
                "native engine: generate_partial while other requests run; use submit/step (or AsyncEngine) for both"
            )
        handles = scheduler.submit_all(requests, params)
        index = {h: i for i, h in enumerate(handles)}
        countdown = GroupCountdown(groups, need, wait_for)
        done: dict[int, Completion] = {}
        try:
            if requests:  # a cache sized by demand is sized once for the whole call, by its longest sequence
                longest = max(len(r.prompt_ids) + (r.max_new_tokens or params.max_new_tokens) for r in requests)
                self.kv_allocator(0, blocks_for(longest - 1, self.block_size))
            with frozen_heap(), self._launches():
                longest = 0  # the most tokens a request of this call has sampled
                while scheduler.has_work and not (countdown.done and has_tail(scheduler, longest)):
                    for handle, completion in scheduler.step():
                        done[handle] = completion
                        countdown.finish(index[handle])
                        longest = max(longest, len(completion.token_ids))
                    longest = max([longest, *(s.launched for s in scheduler.rows)])
                if scheduler.has_work:
                    done.update(scheduler.stop())
        except BaseException:
            scheduler.abort()  # nothing half-done is left for the next call
            raise
        return [done[h] for h in handles]
