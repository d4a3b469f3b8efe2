"""Prompt datasets (JSONL / Parquet / GSM8K), their errors, prompt rendering, and DataSource."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from miles_core.config import FileDataConfig
from miles_core.data import DataSource, PromptRow, load_prompt_rows, render_prompt, rows_from_dicts

REPO = Path(__file__).resolve().parents[2]
GSM8K_DIR = Path(os.environ.get("MILES_GSM8K_DIR", REPO / "datasets" / "gsm8k"))


def write_jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def rows(n: int) -> list[PromptRow]:
    return rows_from_dicts([{"prompt": f"p{i}", "label": str(i)} for i in range(n)], "prompt", "label", "test")


# ---------------------------------------------------------------------------------- loading


def test_jsonl_rows_skip_blank_lines_and_keep_metadata(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps({"q": "1+1=", "a": 2, "src": "x"}),
            "",
            "   ",
            json.dumps({"q": "2+2=", "a": "4", "src": "y"}),
        ],
    )
    got = load_prompt_rows(FileDataConfig(path=path, input_key="q", label_key="a", metadata_keys=["src"]))
    assert got == [
        PromptRow(index=0, prompt="1+1=", label="2", metadata={"src": "x"}),
        PromptRow(index=1, prompt="2+2=", label="4", metadata={"src": "y"}),
    ]


def test_json_array_file_and_no_label(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))
    got = load_prompt_rows(FileDataConfig(path=str(path), label_key=None))
    assert [(r.prompt, r.label) for r in got] == [("a", None), ("b", None)]


def test_relative_path_and_file_url(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "label": "1"})])
    monkeypatch.chdir(tmp_path)
    assert load_prompt_rows(FileDataConfig(path="d.jsonl"))[0].prompt == "a"
    assert load_prompt_rows(FileDataConfig(path=f"file://{tmp_path}/d.jsonl"))[0].label == "1"


def test_parquet_rows_read_only_needed_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["x", "y"], "label": [3, 4], "big": [b"..", b".."]}), path)
    got = load_prompt_rows(FileDataConfig(path=str(path)))
    assert [(r.index, r.prompt, r.label) for r in got] == [(0, "x", "3"), (1, "y", "4")]


def test_parquet_missing_column_lists_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["x"], "answer": ["1"]}), path)
    with pytest.raises(ValueError, match=r"d\.parquet: missing column 'prompt'.*\['question', 'answer'\]"):
        load_prompt_rows(FileDataConfig(path=str(path)))


def test_memory_filesystem():
    import fsspec

    with fsspec.open("memory://miles-test/d.jsonl", "w") as f:
        f.write(json.dumps({"prompt": "m", "label": "0"}) + "\n")
    assert load_prompt_rows(FileDataConfig(path="memory://miles-test/d.jsonl"))[0].prompt == "m"


@pytest.mark.parametrize(("split", "count"), [("train", 7473), ("test", 1319)])
def test_gsm8k_loads(split, count):
    cfg = FileDataConfig(path=str(GSM8K_DIR / f"{split}.jsonl"), input_key="question", label_key="answer")
    got = load_prompt_rows(cfg)
    assert len(got) == count
    assert got[-1].index == count - 1
    assert all(r.label.rsplit("####", 1)[1].strip().replace(",", "").lstrip("-").isdigit() for r in got)
    if split == "train":
        assert got[0].prompt.startswith("Natalia sold clips")
        assert got[0].label.endswith("#### 72")


# ----------------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"dataset file not found: .*nope\.jsonl"):
        load_prompt_rows(FileDataConfig(path=str(tmp_path / "nope.jsonl")))


def test_unsupported_extension(tmp_path):
    (tmp_path / "d.csv").write_text("prompt,label\n")
    with pytest.raises(ValueError, match=r"d\.csv: unsupported dataset file type '\.csv'.*\.jsonl, \.json, \.parquet"):
        load_prompt_rows(FileDataConfig(path=str(tmp_path / "d.csv")))


def test_malformed_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "label": "1"}), "", '{"prompt": "b",'])
    with pytest.raises(ValueError, match=r"d\.jsonl: line 3: malformed JSON"):
        load_prompt_rows(FileDataConfig(path=path))


def test_row_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "label": "1"}), "[1, 2]"])
    with pytest.raises(ValueError, match=r"d\.jsonl: line 2: expected a JSON object per row, got list"):
        load_prompt_rows(FileDataConfig(path=path))


def test_missing_input_key_names_key_row_and_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "label": "1"}), json.dumps({"question": "b"})])
    with pytest.raises(ValueError) as e:
        load_prompt_rows(FileDataConfig(path=path))
    assert "d.jsonl: line 2: missing key 'prompt'" in str(e.value)
    assert "['question']" in str(e.value) and "data.input_key" in str(e.value)


def test_missing_label_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "answer": "1"})])
    with pytest.raises(ValueError, match=r"line 1: missing key 'label'.*\['answer', 'prompt'\].*data.label_key"):
        load_prompt_rows(FileDataConfig(path=path))


def test_non_string_prompt(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": ["a"], "label": "1"})])
    with pytest.raises(ValueError, match=r"line 1: prompt field 'prompt' must be a string, got list"):
        load_prompt_rows(FileDataConfig(path=path))


def test_empty_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", ""])
    with pytest.raises(ValueError, match=r"d\.jsonl: the dataset has no rows"):
        load_prompt_rows(FileDataConfig(path=path))


# ----------------------------------------------------------------------------------- render


def test_prompt_template_with_metadata():
    row = PromptRow(0, "2+2?", "4", {"topic": "sums"})
    cfg = FileDataConfig(path="x.jsonl", prompt_template="[{topic}] Q: {prompt}\nA:")
    assert render_prompt(row, cfg) == "[sums] Q: 2+2?\nA:"
    with pytest.raises(ValueError, match=r"prompt_template .* cannot be formatted.*KeyError"):
        render_prompt(row, FileDataConfig(path="x.jsonl", prompt_template="{question}"))


def test_chat_template_rendering_and_missing_template_error():
    from miles_core.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    row = PromptRow(0, "2+2?", "4")
    cfg = FileDataConfig(path="x.jsonl", prompt_template="Q: {prompt}", apply_chat_template=True)
    with pytest.raises(ValueError, match=r"apply_chat_template is true but the tokenizer .* has no chat template"):
        render_prompt(row, cfg, tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert render_prompt(row, cfg, tokenizer) == "<user>Q: 2+2?\n<assistant>"


def test_prompts_get_the_tokenizers_bos_unless_a_chat_template_already_gave_it():
    """A tokenizer whose post-processor adds <bos> (as Llama's does): a plain prompt gets it, as the
    model saw in pretraining; a chat template's text carries its own and gets no second one."""
    from tokenizers.processors import TemplateProcessing

    from miles_core.models.tiny import build_tokenizer
    from miles_core.session.parts import render

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.chat_template = "<s>{% for m in messages %}{{ m['content'] }}{% endfor %}"
    row = PromptRow(0, "2+2?", "4")
    plain = render([row], FileDataConfig(path="x.jsonl"), tokenizer)[0]
    chat = render([row], FileDataConfig(path="x.jsonl", apply_chat_template=True), tokenizer)[0]
    body = tokenizer("2+2?", add_special_tokens=False)["input_ids"]
    assert plain.prompt_ids == [bos, *body]
    assert chat.prompt_ids == [bos, *body]  # the template's <s>, not two


# ------------------------------------------------------------------------------- DataSource


def test_epoch_crossing_serves_every_row_once_per_epoch():
    source = DataSource(rows(5), seed=0, shuffle=True)
    first = source.next_batch(3) + source.next_batch(3)  # the second batch crosses into epoch 1
    assert source.epoch == 1
    rest = source.next_batch(4)  # ends exactly at the end of epoch 1
    assert sorted(r.index for r in first[:5]) == list(range(5))
    assert sorted(r.index for r in first[5:] + rest) == list(range(5))
    assert (source.epoch, source.state()["position"]) == (2, 0)


def test_unshuffled_order_and_deterministic_shuffle():
    plain = DataSource(rows(4), seed=0, shuffle=False)
    assert [r.index for r in plain.next_batch(6)] == [0, 1, 2, 3, 0, 1]
    a = [r.index for r in DataSource(rows(50), seed=7, shuffle=True).next_batch(150)]
    b = [r.index for r in DataSource(rows(50), seed=7, shuffle=True).next_batch(150)]
    c = [r.index for r in DataSource(rows(50), seed=8, shuffle=True).next_batch(150)]
    assert a == b and a != c
    assert a[:50] != a[50:100]  # reshuffled each epoch
    assert a[:50] != list(range(50))


def test_restored_source_continues_identically():
    original = DataSource(rows(7), seed=3)
    original.next_batch(5)
    original.push_back(original.next_batch(2))
    saved = json.loads(json.dumps(original.state()))  # the state is JSON-able
    restored = DataSource(rows(7), seed=3)
    restored.load_state(saved)
    for n in (3, 4, 9, 1):
        assert [r.index for r in restored.next_batch(n)] == [r.index for r in original.next_batch(n)]
    assert restored.state() == original.state()


def test_load_state_rejects_other_dataset_or_seed():
    state = DataSource(rows(7), seed=3).state()
    with pytest.raises(ValueError, match="saved for .* resume with the same dataset and seed"):
        DataSource(rows(8), seed=3).load_state(state)
    with pytest.raises(ValueError, match="saved for"):
        DataSource(rows(7), seed=4).load_state(state)


def test_push_back_is_served_first():
    source = DataSource(rows(6), seed=0, shuffle=False)
    batch = source.next_batch(3)
    source.push_back(batch[1:])
    assert [r.index for r in source.next_batch(3)] == [1, 2, 3]
    assert [r.index for r in source.next_batch(2)] == [4, 5]
    with pytest.raises(ValueError, match="no row with index 99"):
        source.push_back([PromptRow(99, "x")])


def test_empty_source_is_an_error():
    with pytest.raises(ValueError, match="at least one prompt row"):
        DataSource([], seed=0)
