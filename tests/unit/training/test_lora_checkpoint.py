"""LoRA checkpoints: adapters and their optimizer state only, an exact restore, a resumed run equal to an
uninterrupted one, and the export as a PEFT adapter folder or (`--merge`) as the merged model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from hybridrl.checkpoints import CheckpointDir
from tests.unit.test_checkpoints import assert_same_metrics, kill_and_resume
from tests.unit.training.test_lora import ALPHA, RANK, lora_worker, train_once, trainer_params


def checkpoint(worker, tmp_path):
    ckpt = CheckpointDir(tmp_path, 1)
    tmp = ckpt.staging(1)
    worker.save_checkpoint(str(tmp))
    return ckpt.publish(tmp, 1, {"loader": {}, "config": OmegaConf.to_container(OmegaConf.structured(worker.cfg))})


def optimizer_state(worker) -> dict[str, torch.Tensor]:
    actor = worker.roles.actor
    names = {id(p): n for n, p in actor.model.named_parameters()}
    return {
        f"{names[id(p)]}/{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        for p, st in actor.optimizer.state.items()
        for k, v in st.items()
    }


def test_checkpoint_holds_adapters_only_and_restores_them_exactly(tiny_path, tmp_path, process_group):
    worker = lora_worker(tiny_path)
    train_once(worker)
    path = checkpoint(worker, tmp_path)
    keys = list(dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and not [k for k in model_keys if ".lora_A." not in k and ".lora_B." not in k]
    assert any(k.startswith("optim.") for k in keys)

    fresh = lora_worker(tiny_path)  # new adapters (B = 0), no optimizer state
    fresh.load_checkpoint(str(path))
    assert all(torch.equal(v, trainer_params(fresh)[n]) for n, v in trainer_params(worker).items())
    want, got = optimizer_state(worker), optimizer_state(fresh)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_export_writes_a_peft_adapter_folder_and_the_merged_model(tiny_path, tmp_path, process_group):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridrl.export import main as export_main

    worker = lora_worker(tiny_path)
    train_once(worker)
    path = checkpoint(worker, tmp_path)
    trained = trainer_params(worker)

    assert (
        export_main(["--checkpoint", str(path), "--output", str(tmp_path / "adapter"), "--model-path", tiny_path]) == 0
    )
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), tmp_path / "adapter").eval()
    ids = torch.tensor([[5, 17, 3, 9, 11, 40, 41], [21, 2, 40, 7, 7, 7, 1]])
    actor = worker.roles.actor.model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, actor(ids).logits, atol=1e-5)

    assert (
        export_main(
            ["--checkpoint", str(path), "--output", str(tmp_path / "merged"), "--merge", "--model-path", tiny_path]
        )
        == 0
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    scale = ALPHA / RANK
    plain = {n.replace(".base_layer.", "."): v for n, v in trained.items() if ".lora_" not in n}
    plain.setdefault("lm_head.weight", plain["model.embed_tokens.weight"])  # tied
    n_adapted = 0
    for name, value in merged.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{module}.lora_A.default.weight" in trained:
            a, b = trained[f"{module}.lora_A.default.weight"], trained[f"{module}.lora_B.default.weight"]
            want = plain[name] + scale * b @ a  # W + (alpha/rank)·B·A, written out here
            n_adapted += 1
        else:
            want = plain[name]
        assert (value - want).abs().max() < 1e-6, name
    assert n_adapted == 2 * 7


ARGS = [
    "data.train_batch_size=4",
    "algorithm.group_size=4",
    "logger.progress_bar=false",
    "trainer.save_every=3",
    "trainer.steps=6",
    "model.lora.rank=8",
    "trainer.lr=2e-2",
]


@pytest.mark.slow
def test_lora_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    a, b, _ = kill_and_resume(ARGS, tmp_path)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert a[-1]["actor/kl"] > 0  # the adapters did move the policy away from the base
    assert_same_metrics(a, b)
