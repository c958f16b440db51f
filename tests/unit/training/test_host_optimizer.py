"""AdamW with its moments on the host (`trainer.optimizer_on_host`): the streamed step equals torch's AdamW.

On a CPU device the chunked path runs synchronously over the same memory; every expected value comes from
`torch.optim.AdamW` on the same parameters and gradients (the ordinary path), never from the code under test."""

from __future__ import annotations

import pytest
import torch

from hybridrl.errors import ConfigError
from hybridrl.training.config import TrainerConfig
from hybridrl.training.critic_config import CriticConfig
from hybridrl.training.host_optimizer import HostAdamW, chunk_slices


def test_chunks_cut_parameters_end_to_end():
    # Parameters of 5, 3 and 9 elements in chunks of 4: (item, start, stop, offset in the chunk) by hand.
    got = [[(s.item, s.start, s.stop, s.offset) for s in c] for c in chunk_slices([5, 3, 9], 4)]
    assert got == [
        [(0, 0, 4, 0)],
        [(0, 4, 5, 0), (1, 0, 3, 1)],
        [(2, 0, 4, 0)],
        [(2, 4, 8, 0)],
        [(2, 8, 9, 0)],
    ]


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((7, 3), (11,), (2, 5, 4), (1,))]


@pytest.mark.parametrize("chunk", [6, 64, 1000])
def test_streamed_step_equals_torch_adamw(chunk):
    """Several steps with weight decay, a parameter left without a gradient in one step and an lr change between
    steps (the schedule's way): parameters and moments equal the ordinary AdamW's bit for bit."""
    ref, host = _params(0), _params(0)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref, **kw)
    opt_host = HostAdamW(host, device=torch.device("cpu"), chunk_elements=chunk, **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        for a, b in zip(ref, host):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        if step == 1:
            ref[1].grad = host[1].grad = None  # no gradient: no update, no state advance
        opt_ref.step()
        opt_host.step()
        for opt in (opt_ref, opt_host):
            opt.param_groups[0]["lr"] *= 0.5
    for a, b in zip(ref, host):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_ref.state[a][key], opt_host.state[b][key]), key
    assert opt_host.state[host[1]]["step"].item() == 3


def test_the_arena_packs_tensors_into_power_of_two_blocks():
    from hybridrl.training.pinned_arena import PinnedArena

    arena = PinnedArena(pin=False, block_bytes=4096)
    a, b, c = arena.zeros([((10, 10), torch.float32), ((1000,), torch.float32), ((10,), torch.float64)])
    # 400 B at 0 of a first 4096 B block (aligned to 512); 4000 B do not fit its rest: a second block; 80 B go back
    # into the first at 512.
    assert arena.reserved_bytes == 2 * 4096
    assert c.data_ptr() - a.data_ptr() == 512
    assert b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert all(t.abs().sum() == 0 for t in (a, b, c)) and (c.dtype, c.shape) == (torch.float64, (10,))
    a.fill_(1.0)
    assert c.abs().sum() == 0  # no overlap
    (big,) = arena.zeros([((3000,), torch.float32)])  # 12,000 B: a block of its own, the next power of two
    assert arena.reserved_bytes == 2 * 4096 + 16384 and big.numel() == 3000


def test_the_rollout_offloader_takes_its_buffers_from_one_arena_block():
    from hybridrl.training.offload import HostOffloader

    tensors = [torch.full((300,), 1.0), torch.full((700,), 2.0), torch.full((50,), 3.0)]  # 1,200 + 2,800 + 200 B
    off = HostOffloader(lambda: tensors, torch.device("cpu"), enabled=True)
    assert off.offload() == 4_200
    # Aligned to 512 they take 1,536 + 3,072 + 512 = 5,120 B: one 8,192 B block (one pinned allocation each would
    # round up to 2,048 + 4,096 + 256, and waste more at larger sizes).
    assert off._arena.reserved_bytes == 8192
    assert off.onload() == 4_200
    assert [t.unique().item() for t in tensors] == [1.0, 2.0, 3.0]


def test_moments_return_to_the_host_after_a_load():
    params = _params(0)
    opt = HostAdamW(params, device=torch.device("cpu"), lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    again = HostAdamW(params, device=torch.device("cpu"), lr=1e-3)
    again.load_state_dict(saved)
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert again.state[p][key].device.type == "cpu"
            assert torch.equal(again.state[p][key], opt.state[p][key])
    assert again.host_bytes() == opt.host_bytes() == 2 * 4 * sum(p.numel() for p in params)


def test_amsgrad_is_refused():
    with pytest.raises(ValueError, match="amsgrad"):
        HostAdamW(_params(0), device=torch.device("cpu"), lr=1e-3, amsgrad=True)


def test_config_keys_name_themselves_and_the_critic_follows_the_actor():
    with pytest.raises(ConfigError, match="trainer.optimizer_on_host must be true or false"):
        TrainerConfig(optimizer_on_host="yes")
    with pytest.raises(ConfigError, match="critic.optimizer_on_host"):
        CriticConfig(optimizer_on_host="yes")
    on = TrainerConfig(optimizer_on_host=True)
    assert CriticConfig().optim(on).optimizer_on_host is True
    assert CriticConfig(optimizer_on_host=False).optim(on).optimizer_on_host is False
    assert CriticConfig(optimizer_on_host=True).optim(TrainerConfig()).optimizer_on_host is True


# -- the FSDP2 roles (world size 1, gloo) -----------------------------------------------------------------------


def _update(worker, batch) -> None:
    from hybridrl.batch import Batch

    b = Batch(batch.prompts, dict(batch.tensors), dict(batch.meta))
    for k, v in worker.logprob(b).items():
        b[k] = v
    b["advantages"] = torch.linspace(-1, 1, len(b))
    worker.update(b)


def _worker(tiny_path, tokenizer, on_host: bool, **kw):
    from tests.unit.training.test_trainer import make_trainer

    torch.manual_seed(0)
    return make_trainer(tiny_path, tokenizer, optimizer_on_host=on_host, weight_decay=0.01, **kw)


@pytest.fixture()
def batch(tiny_path, tokenizer, process_group):
    """A rollout of the tiny model: two prompts, four samples each (`test_trainer`'s)."""
    from tests.unit.training import test_trainer

    return test_trainer.rollout(*test_trainer.setup.__wrapped__(tiny_path, tokenizer, process_group))


def _moments_local(optimizer) -> list[torch.Tensor]:
    return [st[k] for st in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]


def _moments(optimizer) -> list[torch.Tensor]:
    return [st[k].full_tensor() for st in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]


def test_actor_updates_equal_the_ordinary_step(tiny_path, tokenizer, batch):
    from tests.unit.training.test_trainer import full_params

    runs = []
    for on_host in (False, True):
        worker = _worker(tiny_path, tokenizer, on_host)
        for _ in range(2):
            _update(worker, batch)
        runs.append((full_params(worker), worker.roles.actor))
    (want, ordinary), (got, hosted) = runs
    assert isinstance(hosted.optimizer, HostAdamW) and not isinstance(ordinary.optimizer, HostAdamW)
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert all(torch.equal(a, b) for a, b in zip(_moments(ordinary.optimizer), _moments(hosted.optimizer)))
    # The memory report counts the moments on the host: two float32 tensors per trained parameter.
    stats = hosted.memory_stats()
    assert stats["optimizer_device_gb"] == 0.0
    assert stats["optimizer_host_gb"] == 2 * 4 * sum(p.numel() for p in hosted.model.parameters()) / 2**30


def test_checkpoints_are_the_ordinary_optimizers_either_way(tiny_path, tokenizer, batch, tmp_path):
    """A checkpoint of the ordinary optimizer resumes into the host one and the other way round; the step after
    the resume equals the uninterrupted ordinary run's."""
    from tests.unit.training.test_trainer import full_params

    ordinary = _worker(tiny_path, tokenizer, False)
    _update(ordinary, batch)
    ordinary.roles.actor.save(tmp_path / "ordinary")
    _update(ordinary, batch)
    want = full_params(ordinary)

    hosted = _worker(tiny_path, tokenizer, True)
    _update(hosted, batch)
    hosted.roles.actor.save(tmp_path / "hosted")

    for on_host, folder in ((True, "ordinary"), (False, "hosted")):
        resumed = _worker(tiny_path, tokenizer, on_host)
        resumed.roles.actor.load(tmp_path / folder)
        if on_host:
            optimizer = resumed.roles.actor.optimizer
            states = optimizer.state.values()
            assert all(st[k].to_local().device.type == "cpu" for st in states for k in ("exp_avg", "exp_avg_sq"))
            # A second load copies into the same host tensors: no new host memory per resume.
            ptrs, reserved = (
                [m.to_local().data_ptr() for m in _moments_local(optimizer)],
                optimizer._arena.reserved_bytes,
            )
            resumed.roles.actor.load(tmp_path / folder)
            assert [m.to_local().data_ptr() for m in _moments_local(optimizer)] == ptrs
            assert optimizer._arena.reserved_bytes == reserved
        _update(resumed, batch)
        got = full_params(resumed)
        assert all(torch.equal(want[n], got[n]) for n in want), (on_host, folder)


def test_rollout_offload_leaves_the_hosted_step_unchanged(tiny_path, tokenizer, batch):
    """The worker's phases with every offloader on and a lazy offload that frees everything (the engine finds no
    room), twice: equal to the same worker that never offloads; the optimizer offloader has nothing to move."""
    runs = []
    for offload in (True, False):
        worker = _worker(tiny_path, tokenizer, True, grad_clip=0.0, offload_lazy=True)
        worker.room.free_bytes = lambda: 0
        actor, ref = worker.roles.actor, worker.roles.ref
        for off in (actor.param_offload, ref.offloader, actor.optim_offload):
            off.enabled = offload
        for _ in range(2):
            worker.wake()
            worker.roles.rollout.engine.sleep(2)
            worker.roles.rollout.engine.wake_up(["weights"])
            worker.sleep()
            _update(worker, batch)
            assert actor.optim_offload.device_bytes() == 0
        runs.append({n: p.full_tensor().clone() for n, p in actor.model.named_parameters()})
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_critic_updates_equal_the_ordinary_step(tiny_path, tokenizer, process_group):
    from tests.unit.training.test_critic import make_critic, ragged_batch

    runs = []
    for on_host in (False, True):
        torch.manual_seed(0)
        critic = make_critic(tiny_path, tokenizer, lr=1e-2, weight_decay=0.01, optimizer_on_host=on_host)
        assert isinstance(critic.optimizer, HostAdamW) == on_host
        b = ragged_batch()
        b["returns"] = torch.tensor([[1.0, 1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
        for _ in range(2):
            b["values"] = critic.compute_values(critic.micro_batches(b))[0]["values"]
            critic.update(b)
        runs.append({n: p.full_tensor().clone() for n, p in critic.model.named_parameters()})
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
