"""A worker group whose engines are a token clock: every running request gains one token per engine step (its value:
its position in the response; its log-prob: -(step + position / 100)), up to its sample's target length (then
'stop') or its cap (then 'length'); a replica stops once its quota of groups is complete. Targets are fixed per
sample (prompt, sample index), so a carried sample finishes when its tokens over all steps reach its target, and
everything a test asserts can be counted by hand."""

from __future__ import annotations

from contextlib import contextmanager

from omegaconf import OmegaConf

from hybridrl.config import RunConfig, validate
from hybridrl.data.prompts import Prompt, PromptLoader
from hybridrl.engines.base import Completion, GroupCountdown
from hybridrl.phases import Phase
from hybridrl.rollout.partial import PartialRollout
from hybridrl.rollout.scoring import rollout_batch
from hybridrl.topology import Topology

PROMPT_LEN = 3


def make_prompts(n: int) -> list[Prompt]:
    """Prompt i is [1000 + i] * PROMPT_LEN (its first token names it)."""
    return [Prompt([1000 + i] * PROMPT_LEN, f"p{i}", {"id": i}) for i in range(n)]


def prompt_id(token_ids) -> int:
    return token_ids[0] - 1000


class ClockGroup:
    """The `WorkerGroup` surface `PartialRollout` uses, over `world` ranks of engine TP 1."""

    def __init__(self, targets, world: int = 1) -> None:
        self.targets = targets  # (prompt id, sample index) -> response length at which the sample stops
        self.topology = Topology(world, 1)
        self.calls: list[dict] = []  # per GENERATE_PARTIAL call and replica: what it was asked
        self.sleeps = 0

    def run(self, phase, per_rank_args=None, **kwargs):
        if phase == Phase.SLEEP:
            self.sleeps += 1
            return [None] * self.topology.world_size
        assert phase == Phase.GENERATE_PARTIAL, phase
        return [self._replica(*args) for args in per_rank_args]

    def run_all(self, phase, *args, **kwargs):
        return self.run(phase, [args] * self.topology.world_size, **kwargs)

    def _replica(self, share, step, params):
        requests, groups, need, wait_for = share.requests, share.groups, share.need, share.wait_for
        self.calls.append(
            {"step": step, "need": need, "wait_for": list(wait_for), "requests": list(requests), "groups": list(groups)}
        )
        tokens: list[list[int]] = [[] for _ in requests]
        finish: list[str | None] = [None] * len(requests)
        countdown, counted = GroupCountdown(groups, need, wait_for), set()
        while not countdown.done and any(f is None for f in finish):
            for i, r in enumerate(requests):
                if finish[i] is not None:
                    continue
                before = len(r.prompt_ids) - PROMPT_LEN  # carried tokens
                tokens[i].append(before + len(tokens[i]))  # token value = its position in the response
                cap = params.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
                if before + len(tokens[i]) == self.targets[(prompt_id(r.prompt_ids), r.sample_index)]:
                    finish[i] = "stop"
                elif len(tokens[i]) == cap:
                    finish[i] = "length"
            for i, f in enumerate(finish):  # finished in this engine step, in request order
                if f is not None and i not in counted:
                    counted.add(i)
                    countdown.finish(i)
        # A token's log-prob names the step whose rollout sampled it and its position: -(step + position / 100).
        return [
            Completion(r.prompt_index, t, [-(step + k / 100) for k in t], f or "partial")
            for r, t, f in zip(requests, tokens, finish)
        ]


def run_config(*overrides: str) -> RunConfig:
    base = [
        "data.train_batch_size=2",
        "algorithm.group_size=2",
        "engine.max_new_tokens=10",
        "rollout.partial.enabled=true",
        "rollout.partial.oversample=0.5",
    ]
    return validate(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist([*base, *overrides])))


@contextmanager
def untimed(phase):
    yield


def partial_rollout(cfg: RunConfig, group: ClockGroup, prompts: list[Prompt], score=None) -> PartialRollout:
    loader = PromptLoader(prompts, cfg.data.train_batch_size, shuffle=False, seed=0)
    return PartialRollout(
        cfg, loader, prompts, group, untimed, lambda p, o: rollout_batch(p, o, agent=False), score or (lambda b: None)
    )
