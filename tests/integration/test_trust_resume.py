"""Resume: which config changes apply or are refused, the new lr reaching the optimizer, one metrics row per step."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from hybridrl.config import RunConfig
from hybridrl.errors import ConfigError
from hybridrl.resume_policy import APPLY, REFUSE, RULES, enforce_resume_policy, resume_config_diff, rule_for
from hybridrl.training.checkpoint import apply_lr
from hybridrl.training.schedule import build_scheduler


def schema() -> dict:
    return OmegaConf.to_container(OmegaConf.structured(RunConfig))


def changed(**dotted) -> dict:
    cfg = OmegaConf.structured(RunConfig)
    for k, v in dotted.items():
        OmegaConf.update(cfg, k.replace("__", "."), v)
    return OmegaConf.to_container(cfg)


@pytest.mark.parametrize(
    "key, value",
    [
        ("trainer.steps", 500),
        ("trainer.save_every", 7),
        ("trainer.eval_every", 3),
        ("trainer.keep_last", 5),
        ("trainer.lr", 3e-5),
        ("trainer.warmup_steps", 4),
        ("trainer.lr_schedule", "cosine"),
        ("trainer.min_lr_ratio", 0.1),
        ("logger.name", "wandb"),
        ("logger.tags", ["x"]),
        ("cluster.collective_timeout_s", 30.0),
        ("trainer.resume", "auto"),
        ("reshard.verify", True),
    ],
)
def test_keys_that_may_change_are_applied(key, value):
    assert resume_config_diff(schema(), changed(**{key: value})) == ([key], [])


@pytest.mark.parametrize(
    "key, value",
    [
        ("model.path", "/other"),
        ("model.tiny.hidden_size", 128),
        ("data.path", "/other.jsonl"),
        ("data.seed", 3),
        ("data.train_batch_size", 32),
        ("algorithm.group_size", 4),
        ("algorithm.kl_coef", 0.0),
        ("trainer.seed", 1),
        ("trainer.betas", [0.9, 0.99]),
        ("trainer.mini_batch_size", 8),
        ("cluster.workers_per_node", 2),
        ("cluster.nnodes", 2),
        ("engine.tp_size", 2),
        ("engine.temperature", 0.7),
        ("reward.name", "math"),
    ],
)
def test_keys_that_define_the_experiment_are_refused(key, value):
    assert resume_config_diff(schema(), changed(**{key: value})) == ([], [key])


def test_unchanged_config_is_no_change_and_order_is_sorted():
    assert resume_config_diff(schema(), schema()) == ([], [])
    applied, refused = resume_config_diff(
        schema(), changed(trainer__steps=9, trainer__lr=0.5, data__seed=2, model__path="/m")
    )
    assert applied == ["trainer.lr", "trainer.steps"] and refused == ["data.seed", "model.path"]


def test_keys_only_one_side_has_compare_with_defaults():
    saved = schema()
    del saved["trainer"]["eval_samples"]  # a checkpoint written before this key existed
    assert resume_config_diff(saved, schema()) == ([], [])
    assert resume_config_diff(saved, schema(), defaults=schema()) == ([], [])
    now = changed(trainer__eval_samples=4)
    assert resume_config_diff(saved, now, defaults=schema()) == (["trainer.eval_samples"], [])
    saved["some_future_role"] = {"lr": 1e-5}  # a section this version does not have: with no default, not a change
    assert resume_config_diff(saved, schema()) == ([], [])
    assert resume_config_diff({}, {"new_section": {"x": 1}}, defaults={"new_section": {"x": 2}}) == (
        [],
        ["new_section.x"],
    )


def test_every_schema_key_is_classified_by_a_named_rule():
    """A key that only the catch-all matches is refused on resume without anyone having decided it: name it in RULES."""
    from hybridrl.resume_policy import flatten

    assert RULES[-1][0] == "*" and RULES[-1][1] == REFUSE
    unclassified = [k for k in flatten(schema()) if rule_for(k)[0] == "*"]
    assert unclassified == []
    assert {r[1] for r in RULES} == {APPLY, REFUSE}


def test_enforce_names_refused_keys_with_values_and_reason():
    with pytest.raises(ConfigError, match=r"algorithm\.group_size \(8 -> 4: the algorithm being run\)"):
        enforce_resume_policy(schema(), changed(algorithm__group_size=4, trainer__lr=0.1))
    assert (
        enforce_resume_policy(schema(), changed(trainer__lr=3e-5))
        == "resume: config changes applied: trainer.lr 1e-06 -> 3e-05"
    )
    assert enforce_resume_policy(schema(), schema()) is None


# ---------------------------------------------------------------- apply_lr


def _opt(lr: float, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3).double()  # float64: the update ratios below are exact to ~1e-12
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = build_scheduler(opt, warmup=2, total=10, kind="cosine", min_ratio=0.1)
    return model, opt, sched


def _step(model, opt, sched):
    torch.manual_seed(1)
    model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_apply_lr_replaces_the_peak_and_keeps_the_schedule_position():
    model, opt, sched = _opt(1e-3)
    for _ in range(5):
        _step(model, opt, sched)
    state = (model.state_dict(), opt.state_dict(), sched.state_dict())
    # A resume with trainer.lr=5e-3: fresh objects from the new config, then the checkpoint's state loaded.
    m2, o2, s2 = _opt(5e-3)
    m2.load_state_dict(state[0])
    o2.load_state_dict(state[1])
    s2.load_state_dict(state[2])
    assert o2.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.7222075)  # the checkpoint's lr: the bug
    assert apply_lr(o2, s2, 5e-3) is True
    # cosine after 2 warmup steps over 8: step 5 -> progress 3/8; 0.1 + 0.9 * 0.5 * (1 + cos(3pi/8)) = 0.7222075
    factor5 = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 8))
    assert factor5 == pytest.approx(0.7222075, abs=1e-7)
    assert o2.param_groups[0]["lr"] == pytest.approx(5e-3 * factor5, rel=1e-12)
    assert s2.get_last_lr() == [pytest.approx(5e-3 * factor5, rel=1e-12)] and s2.base_lrs == [5e-3]
    _step(m2, o2, s2)  # step 6 -> progress 4/8: factor 0.1 + 0.45 * (1 + 0) = 0.55
    assert o2.param_groups[0]["lr"] == pytest.approx(5e-3 * 0.55, rel=1e-12)
    assert apply_lr(o2, s2, 5e-3) is False  # already the peak


def test_the_optimizer_step_uses_the_applied_lr():
    """AdamW's update is proportional to lr for the same state: with 3x the lr applied, the next update is 3x."""
    deltas = []
    for lr in (1e-3, 3e-3):
        model, opt, sched = _opt(1e-3)
        for _ in range(3):
            _step(model, opt, sched)
        apply_lr(opt, sched, lr)
        before = model.weight.detach().clone()
        torch.manual_seed(1)
        model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
        opt.step()  # AdamW's decoupled weight decay is lr-proportional too: compare the whole update
        deltas.append(model.weight.detach() - before)
    assert torch.allclose(deltas[1], 3 * deltas[0], rtol=1e-9, atol=0)


def test_load_trainer_applies_a_new_lr(tmp_path, tiny_path, tokenizer, process_group):
    from hybridrl.training.checkpoint import load_trainer
    from tests.helpers.roles import make_actor

    old = make_actor(tiny_path, lr=1e-3)
    old.save(str(tmp_path))
    new = make_actor(tiny_path, lr=4e-3)
    load_trainer(new.model, new.optimizer, new.scheduler, tmp_path)
    assert new.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # without lr=: the checkpoint's
    load_trainer(new.model, new.optimizer, new.scheduler, tmp_path, lr=4e-3)
    assert new.optimizer.param_groups[0]["lr"] == pytest.approx(4e-3) and new.scheduler.get_last_lr() == [
        pytest.approx(4e-3)
    ]


# ---------------------------------------------------------------- one metrics row per step


def _tracker(run_dir):
    from hybridrl.tracking.config import LoggerConfig
    from hybridrl.tracking.tracker import Tracker

    return Tracker(LoggerConfig(progress_bar=False, plot=False), run_dir, {}, "job", None)


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_fresh_start_moves_a_dead_runs_metrics_aside(tmp_path):
    dead = _tracker(tmp_path)
    for s in (1, 2, 3):
        dead.log(s, {"reward/mean": 0.1})
    fresh = _tracker(tmp_path)  # resume=auto found no checkpoint: nothing resumed
    for s in (1, 2):
        fresh.log(s, {"reward/mean": 0.2})
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2]
    stale = list(tmp_path.glob("metrics.jsonl.stale-*"))
    assert len(stale) == 1 and _steps(stale[0]) == [1, 2, 3]  # kept, not deleted
    again = _tracker(tmp_path)
    again.log(1, {})
    assert len(list(tmp_path.glob("metrics.jsonl.stale-*"))) == 2  # a second fresh start keeps both


def test_a_resumed_run_keeps_rows_up_to_its_checkpoint(tmp_path):
    first = _tracker(tmp_path)
    for s in (1, 2, 3, 4):
        first.log(s, {})
    resumed = _tracker(tmp_path)
    resumed.resume_at(3)
    resumed.log(4, {})
    resumed.log(5, {})
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5]
    assert not list(tmp_path.glob("metrics.jsonl.stale-*"))
