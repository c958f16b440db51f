"""Prompt data: the synthetic task, user JSONL/Parquet files, length limits, resumable batching."""

from __future__ import annotations

import json

import pytest

from hybridrl.data.config import DataConfig, SyntheticOptions
from hybridrl.data.prompts import PromptLoader, load_prompts
from hybridrl.data.synthetic import digit_match_score, make_synthetic_rows, synthetic_reward
from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.rewards import RewardInput


def test_synthetic_rows_are_deterministic_and_val_is_disjoint(tokenizer):
    cfg = DataConfig(synthetic=SyntheticOptions(task="sort", num_prompts=200, num_val_prompts=20))
    train, val = load_prompts(cfg, tokenizer)
    train2, _ = load_prompts(cfg, tokenizer)
    assert [p.text for p in train] == [p.text for p in train2]
    assert not {p.sample["digits"] for p in train} & {p.sample["digits"] for p in val}
    row = train[0].sample
    assert row["answer"] == "".join(sorted(row["digits"]))
    assert train[0].text.startswith("<|im_start|>user\nsort: ")


@pytest.mark.parametrize(
    "task, digits, answer",
    [("copy", "305", "305"), ("reverse", "305", "503"), ("sort", "305", "035"), ("add", "1234", "46")],
)
def test_synthetic_answers(task, digits, answer):
    rows = make_synthetic_rows(task, 50, 3, 4, seed=1)
    assert all(r["task"] == task for r in rows)
    from hybridrl.data.synthetic import _answer

    assert _answer(task, digits) == answer


def test_synthetic_reward_components():
    def score(response, finish="stop"):
        return synthetic_reward([RewardInput("p", response, {"answer": "123"}, finish)])[0]

    assert score("123") == {"score": 1.0, "format": 1.0, "correct": 1.0, "exact": 1.0}
    assert score("124")["correct"] == pytest.approx(2 / 3)
    assert score("12a") == pytest.approx(
        {"score": 0.5 * (2 / 3) + 0.5 * (2 / 3), "format": 2 / 3, "correct": 2 / 3, "exact": 0.0}
    )
    assert score("123", finish="length")["format"] == 0.5
    assert score("")["score"] == 0.0
    assert digit_match_score("12345", "123") == pytest.approx(3 / 5)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_prompts_with_strings_and_messages(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [{"question": "what is 2+2?", "gt": "4"}, {"question": [{"role": "user", "content": "hi"}], "gt": "x"}],
    )
    cfg = DataConfig(name="jsonl", path=path, prompt_key="question", answer_key="gt", system_prompt="be brief")
    train, val = load_prompts(cfg, tokenizer)
    assert val == [] and len(train) == 2
    assert train[0].sample["answer"] == "4" and train[0].sample["gt"] == "4"
    assert train[0].text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is 2+2?")
    assert tokenizer.decode(train[1].token_ids).endswith("<|im_start|>assistant\n")


def test_parquet_prompts(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), tmp_path / "t.parquet")
    train, _ = load_prompts(DataConfig(name="jsonl", path=str(tmp_path / "t.parquet")), tokenizer)
    assert [p.sample["answer"] for p in train] == ["1", "2"]


def test_bad_files_name_the_key_and_the_problem(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="data.path.*file not found"):
        load_prompts(DataConfig(name="jsonl", path=str(tmp_path / "missing.jsonl")), tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(HybridRLError, match="line 2"):
        load_prompts(DataConfig(name="jsonl", path=str(bad)), tokenizer)
    nokey = write_jsonl(tmp_path / "nokey.jsonl", [{"text": "x"}])
    with pytest.raises(HybridRLError, match="data.prompt_key"):
        load_prompts(DataConfig(name="jsonl", path=nokey), tokenizer)


def test_check_files_names_a_missing_file_before_anything_is_built(tmp_path):
    present = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "x"}])
    DataConfig(name="jsonl", path=present).check_files()
    DataConfig(name="synthetic").check_files()
    with pytest.raises(ConfigError, match=r"data.path='.*missing.jsonl': file not found"):
        DataConfig(name="jsonl", path=str(tmp_path / "missing.jsonl")).check_files()
    with pytest.raises(ConfigError, match=r"data.val_path='.*nope.jsonl': file not found"):
        DataConfig(name="jsonl", path=present, val_path=str(tmp_path / "nope.jsonl")).check_files()
    with pytest.raises(ConfigError, match="data.path.*file not found"):  # a folder is not a file of prompts
        DataConfig(name="jsonl", path=str(tmp_path)).check_files()


def test_overlong_prompts_error_or_drop(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "short"}, {"prompt": "long " * 50}])
    with pytest.raises(HybridRLError, match=r"row 1 \(from 0\) has .* prompt tokens.*data.max_prompt_tokens=64"):
        load_prompts(DataConfig(name="jsonl", path=path, max_prompt_tokens=64), tokenizer)
    train, _ = load_prompts(
        DataConfig(name="jsonl", path=path, max_prompt_tokens=64, overlong_prompts="drop"), tokenizer
    )
    assert len(train) == 1


def test_loader_epochs_and_resume(tokenizer):
    prompts, _ = load_prompts(DataConfig(synthetic=SyntheticOptions(num_prompts=10, num_val_prompts=1)), tokenizer)
    loader = PromptLoader(prompts, 4, shuffle=True, seed=3)
    seen = [p.text for _ in range(2) for p in loader.next_batch()]
    assert len(set(seen)) == 8  # one epoch: no repeats; the tail of 2 is skipped
    state = loader.state_dict()
    expected = [[p.text for p in loader.next_batch()] for _ in range(3)]
    resumed = PromptLoader(prompts, 4, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    assert [[p.text for p in resumed.next_batch()] for _ in range(3)] == expected


def test_non_utf8_byte_names_the_line(tmp_path, tokenizer):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(
        HybridRLError, match=r"data.path='.*latin1.jsonl': line 3 is not UTF-8 \(byte 0xe9 at column 16\)"
    ):
        load_prompts(DataConfig(name="jsonl", path=str(bad)), tokenizer)


@pytest.mark.parametrize(
    "row, match",
    [
        ({"prompt": None}, r"row 1 \(from 0\): column 'prompt' \(data.prompt_key\) is null"),
        ({"prompt": 7}, r"row 1 \(from 0\): column 'prompt' \(data.prompt_key\) is int 7"),
        ({"prompt": []}, r"row 1 \(from 0\): column 'prompt' \(data.prompt_key\) is list \[\]"),
        ({"prompt": [{"role": "user", "content": None}]}, r"row 1 \(from 0\): message 0 of column 'prompt' is"),
        ({"prompt": ["hi"]}, r"row 1 \(from 0\): message 0 of column 'prompt' is 'hi'"),
    ],
    ids=["null", "number", "empty-list", "null-content", "bare-string-message"],
)
def test_bad_prompt_values_name_the_row(tmp_path, tokenizer, row, match):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(HybridRLError, match=match):
        load_prompts(DataConfig(name="jsonl", path=path), tokenizer)


def test_rows_that_are_not_objects_name_the_line(tmp_path, tokenizer):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a"}\n["prompt", "b"]\n')
    with pytest.raises(HybridRLError, match="line 2 is a JSON list, not an object of columns"):
        load_prompts(DataConfig(name="jsonl", path=str(path)), tokenizer)


def test_a_parquet_name_without_parquet_content(tmp_path, tokenizer):
    pytest.importorskip("pyarrow")
    fake = tmp_path / "train.parquet"
    fake.write_text('{"prompt": "this is JSONL"}\n')
    with pytest.raises(HybridRLError, match=r"data.path='.*train.parquet' is not a readable Parquet file \(.*\)"):
        load_prompts(DataConfig(name="jsonl", path=str(fake)), tokenizer)


def test_null_prompt_in_parquet_names_the_row(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", None]}), tmp_path / "t.parquet")
    with pytest.raises(HybridRLError, match=r"row 1 \(from 0\): column 'prompt' \(data.prompt_key\) is null"):
        load_prompts(DataConfig(name="jsonl", path=str(tmp_path / "t.parquet")), tokenizer)
