"""workers/dist.init_process_group: which backend and device a lone worker's group gets (no process group is made:
torch.distributed's own call is replaced to see its arguments)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridrl.workers import dist as wdist


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict:
    calls: dict = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.delenv(wdist.STORE_FILE_ENV, raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    return calls


def test_cuda_without_an_index_binds_the_current_device(seen: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL's eager init refuses a device without an index ("Please use a device_id with index"); "cuda" means the
    # current device, as torch's own calls read it.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    wdist.init_process_group(0, 1, torch.device("cuda"), timeout_s=5)
    assert seen["backend"] == "nccl"
    assert seen["device_id"] == torch.device("cuda", 3)


def test_cuda_with_an_index_is_kept(seen: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    wdist.init_process_group(0, 1, torch.device("cuda", 1), timeout_s=5)
    assert seen["device_id"] == torch.device("cuda", 1)


def test_cpu_gets_gloo_and_no_device(seen: dict) -> None:
    wdist.init_process_group(0, 1, torch.device("cpu"), timeout_s=5)
    assert seen["backend"] == "gloo" and "device_id" not in seen
