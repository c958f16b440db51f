"""engine.tp_size=2 the way `cluster=local` runs it: two processes join one gloo group, then each builds a
VllmEngine as one TP rank (vLLM's "external_launcher" inside our group), and agent turns run as the worker runs them
at TP 2 (the leader's schedule replayed by the other rank). ~55 s on 2 quiet cores, ~2 min under load."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.paths import REPO
from tests.unit.engines.vllm.vllm_helpers import TOL, hf_logprobs, perturbed

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 90, 91, 92]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_inside_our_process_group(vllm_tiny_path, vllm_hf_model, vllm_state_dict, tmp_path):
    port, here = _free_port(), Path(__file__).parent
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TP_TEST_PROMPTS=json.dumps(PROMPTS),
        PYTHONPATH=os.pathsep.join([str(here), str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(here / "_tp_worker.py"), str(r), "2", str(port), str(vllm_tiny_path), str(outs[r])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=420)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:] if r < len(logs) else ''}"

    r0, r1 = (json.loads(o.read_text()) for o in outs)
    streamed = r0["runs"].pop("streamed")  # agent turns: the leader's; the other rank replayed its schedule
    assert r1["runs"].pop("streamed") == [] and len(streamed) == 4
    assert r0 == r1, "the two TP ranks must return identical samples"
    assert r0["group_alive_after_shutdown"] and r0["agent_turns_batched_per_turn"]
    runs = r0["runs"]
    assert runs["restored"] == runs["original"]
    # Stopped early on both ranks after the same step: prompt 0's group whole, the others cut to what they sampled.
    partial = runs.pop("partial")
    assert [c[3] != "partial" for c in partial[:2]] == [True, True] and "partial" in {c[3] for c in partial[2:]}
    assert all(len(c[1]) <= 3 for c in partial)
    assert (
        max(
            (torch.tensor(lp) - hf_logprobs(vllm_hf_model, PROMPTS[i], ids, 1.0)).abs().max().item()
            for i, ids, lp, _ in partial
            if ids
        )
        < TOL
    )
    assert runs["perturbed"] != runs["original"]

    new_model = type(vllm_hf_model)(vllm_hf_model.config).eval()
    new_model.load_state_dict(perturbed(vllm_state_dict), strict=False)
    for name, model in (("original", vllm_hf_model), ("perturbed", new_model)):
        err = max(
            (torch.tensor(lp) - hf_logprobs(model, PROMPTS[i], ids, 1.0)).abs().max().item()
            for i, ids, lp, _ in runs[name]
        )
        print(f"TP=2 {name}: max |vLLM - HF| log-prob = {err:.2e}")
        assert err < TOL
    # Turns that joined the running batch one by one, computed by both ranks in step: the unsharded model's log-probs.
    err = max(
        (torch.tensor(lp) - hf_logprobs(vllm_hf_model, prompt, ids, 1.0)).abs().max().item()
        for prompt, ids, lp, _ in streamed
    )
    assert err < TOL and all(len(ids) >= 1 for _, ids, _, _ in streamed)
