"""The tiny model's pre-training: its text never holds the task's format, it is deterministic, and it is cached
under its own key (a random-init model keeps the key it always had)."""

from __future__ import annotations

import json

import torch

from hybridrl.models.pretrain import DIGITS, DigitText, PretrainSpec, pretrain_batches
from hybridrl.models.tiny import ensure_tiny_model


def test_the_text_is_digits_and_eos_only(tokenizer) -> None:
    spec = PretrainSpec(steps=1, batch_size=8, seq_len=64)
    batch = next(pretrain_batches(tokenizer, spec))
    assert batch.shape == (8, 64)
    allowed = {tokenizer.convert_tokens_to_ids(ch) for ch in DIGITS} | {tokenizer.eos_token_id}
    assert set(batch.flatten().tolist()) <= allowed  # no chat markup, no letters: no prompt or answer layout
    assert tokenizer.eos_token_id in batch.flatten().tolist()  # documents end


def test_spans_recur_within_a_document_and_the_text_is_seeded() -> None:
    spec = PretrainSpec(seed=3)
    docs = [DigitText(spec).document() for _ in range(2)]
    assert docs[0] == docs[1]  # same seed, same text
    assert DigitText(PretrainSpec(seed=4)).document() != docs[0]
    text = DigitText(spec)
    repeats = 0
    for _ in range(50):
        doc = "".join(map(str, text.document()))
        repeats += any(doc.find(doc[i : i + 6], i + 1) >= 0 for i in range(len(doc) - 6))
    assert repeats >= 25  # most documents hold a 6-digit span twice; random digits would almost never


def test_pretraining_is_cached_under_its_own_key_and_deterministic(tmp_path) -> None:
    plain = ensure_tiny_model(tmp_path)
    assert ensure_tiny_model(tmp_path, PretrainSpec(steps=0)) == plain  # steps=0 is the random init
    spec = PretrainSpec(steps=3, batch_size=4, seq_len=16)
    a = ensure_tiny_model(tmp_path / "a", spec)
    b = ensure_tiny_model(tmp_path / "b", spec)
    assert a.name == b.name != plain.name
    from safetensors.torch import load_file

    wa, wb, w0 = (load_file(p / "model.safetensors") for p in (a, b, plain))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # deterministic for a seed
    assert any(not torch.equal(wa[k], w0[k]) for k in wa)  # and it did train
    assert json.loads((a / "config.json").read_text())["num_hidden_layers"] == 2
