"""Over-sampled, partial rollouts (`rollout.partial`): a step stops generating once it has the groups it trains on.

    partial = PartialRollout(cfg, loader, train_prompts, ...)   # hybridrl/rollout/partial.py, made by the controller
    batch, scores, extras, metrics = partial.rollout(step)      # in place of generate → sleep → batch

config.py      the `rollout` group: its mode and the `rollout.partial` section
pool.py        the groups and samples held from one step to the next (and their checkpoint form)
partial.py     one step's rollout: expire, fill, generate until enough groups are complete, take them
dispatch.py    the requests spread over the engine replicas, each with its quota of groups
generation.py  a worker's part (the engine's `generate_partial`); agent.py the agent loop's
scoring.py     generate on prompts through the worker group and score them (validation, evaluate)
"""

from hybridrl.rollout.config import PartialConfig, RolloutConfig

__all__ = ["PartialConfig", "RolloutConfig"]
