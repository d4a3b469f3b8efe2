"""Named evaluation datasets: the config (``eval.datasets``, checks, ``EvalConfig.resolved``), the
``--eval-prompt-data`` flag in both forms, one evaluation row over several datasets, and a real
evaluation of the tiny model on two datasets with settings of their own."""

from __future__ import annotations

import json
import uuid

import pytest

from miles_core.cli import build_parser, resolve_config
from miles_core.config import EvalConfig, EvalDatasetConfig, FileDataConfig, RolloutConfig, RunConfig, ToyDataConfig
from miles_core.metrics import eval_row


def _cli(*argv: str) -> RunConfig:
    return resolve_config(build_parser().parse_args(["show-config", *argv]))


def always_right(sample) -> float:
    """A reward that marks every response correct (tells which reward scored which dataset)."""
    return 1.0


def response_code(sample) -> float:
    """A reward in [0, 1) that depends on every response token: sampling settings show in its mean
    (the untrained model's answers are all wrong and all truncated, whatever the settings)."""
    return sum((i + 1) * t for i, t in enumerate(sample.response_ids)) % 997 / 997


# ------------------------------------------------------------------------------------- config


def test_dataset_names_must_be_plain_and_unique():
    toy = {"type": "toy"}
    with pytest.raises(ValueError, match=r"eval dataset name 'gsm8k/test': use only letters, digits"):
        EvalDatasetConfig(name="gsm8k/test", data=toy)
    with pytest.raises(ValueError, match="eval dataset name ''"):
        EvalDatasetConfig(name="", data=toy)
    assert EvalDatasetConfig(name="aime_2024-v2", data=toy).name == "aime_2024-v2"
    with pytest.raises(ValueError, match=r"names must be unique; repeated: a \[type"):
        EvalConfig(datasets=[{"name": "a", "data": toy}, {"name": "b", "data": toy}, {"name": "a", "data": toy}])


def test_data_and_datasets_are_not_both_set():
    with pytest.raises(ValueError, match=r"eval.data and eval.datasets are both set: use eval.datasets alone"):
        EvalConfig(data={"type": "toy"}, datasets=[{"name": "a", "data": {"type": "toy"}}])


def test_per_dataset_overrides_are_checked():
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        EvalDatasetConfig(name="a", data={"type": "toy"}, n_samples_per_prompt=0)
    with pytest.raises(ValueError, match="extra"):  # a misspelt override is refused, not ignored
        EvalDatasetConfig(name="a", data={"type": "toy"}, n_sample_per_prompt=4)


def test_toml_datasets_parse(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "[eval]\nnum_prompts = 64\n\n"
        '[[eval.datasets]]\nname = "gsm8k"\nn_samples_per_prompt = 4\ntemperature = 0.7\n'
        'data = { type = "file", path = "datasets/gsm8k/test.jsonl", input_key = "question", label_key = "answer" }\n\n'
        '[[eval.datasets]]\nname = "toy"\nnum_prompts = 16\ndata = { type = "toy" }\n'
    )
    ev = RunConfig.from_toml(path).eval
    gsm8k, toy = ev.datasets
    assert (gsm8k.name, gsm8k.n_samples_per_prompt, gsm8k.temperature, gsm8k.num_prompts) == ("gsm8k", 4, 0.7, None)
    assert isinstance(gsm8k.data, FileDataConfig) and gsm8k.data.input_key == "question"
    assert (toy.name, toy.num_prompts, type(toy.data)) == ("toy", 16, ToyDataConfig)


def test_resolved_fills_unset_settings_from_eval_then_rollout():
    rollout = RolloutConfig(rollout_max_response_len=12, reward="math")
    ev = EvalConfig(num_prompts=64, n_samples_per_prompt=2, temperature=0.5, reward="gsm8k", datasets=[
        {"name": "a", "data": {"type": "toy"}, "num_prompts": 8, "max_response_len": 3},
        {"name": "b", "data": {"type": "toy"}, "n_samples_per_prompt": 4, "temperature": 0.0, "reward": "toy"},
    ])
    a, b = ev.resolved(ToyDataConfig(), rollout)
    # a: its own num_prompts and max_response_len; eval's samples, temperature and reward
    assert (a.name, a.num_prompts, a.n_samples_per_prompt, a.temperature, a.max_response_len, a.reward) == (
        "a", 8, 2, 0.5, 3, "gsm8k")
    # b: its own samples, temperature (0 is a setting, not "unset") and reward; eval.max_response_len
    # is unset, so the rollout's
    assert (b.name, b.num_prompts, b.n_samples_per_prompt, b.temperature, b.max_response_len, b.reward) == (
        "b", 64, 4, 0.0, 12, "toy")
    assert ev.datasets[0].reward is None, "resolving leaves the config as it was"


def test_resolved_without_datasets_is_the_one_heldout_dataset():
    train = ToyDataConfig(num_prompts=32)
    [heldout] = EvalConfig(num_prompts=8).resolved(train, RolloutConfig(rollout_max_response_len=5, reward="toy"))
    assert (heldout.name, heldout.data, heldout.num_prompts, heldout.max_response_len, heldout.reward) == (
        "heldout", train, 8, 5, "toy")
    file = FileDataConfig(path="test.jsonl")
    [heldout] = EvalConfig(data=file).resolved(train, RolloutConfig())
    assert heldout.data == file
    with pytest.raises(ValueError, match="eval.data is required when training on a file dataset"):
        EvalConfig().resolved(FileDataConfig(path="train.jsonl"), RolloutConfig())


# ---------------------------------------------------------------------------------------- CLI


def test_eval_prompt_data_one_path_keeps_its_meaning():
    cfg = _cli("--eval-prompt-data", "gsm8k/test.jsonl", "--prompt-data", "gsm8k/train.jsonl",
               "--input-key", "question", "--label-key", "answer")
    # the training data's keys are inherited even when their flags come after
    assert (cfg.eval.data.path, cfg.eval.data.input_key, cfg.eval.data.label_key) == ("gsm8k/test.jsonl", "question", "answer")
    assert cfg.eval.datasets == []


def test_eval_prompt_data_pairs_make_named_datasets():
    cfg = _cli("--prompt-data", "train.jsonl", "--input-key", "question", "--label-key", "answer",
               "--apply-chat-template", "--eval-prompt-data", "gsm8k", "gsm8k/test.jsonl", "math", "math/test.parquet")
    assert cfg.eval.data is None
    assert [(d.name, d.data.path) for d in cfg.eval.datasets] == [("gsm8k", "gsm8k/test.jsonl"), ("math", "math/test.parquet")]
    for d in cfg.eval.datasets:
        assert (d.data.input_key, d.data.label_key, d.data.apply_chat_template) == ("question", "answer", True), d.name
        assert d.n_samples_per_prompt is None, "settings stay eval's unless set per dataset"


def test_eval_prompt_data_pairs_replace_the_config_files_eval_data(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[eval.data]\ntype = "file"\npath = "old.jsonl"\n')
    cfg = _cli("--config", str(path), "--eval-prompt-data", "a", "a.jsonl", "b", "b.jsonl")
    assert cfg.eval.data is None and [d.name for d in cfg.eval.datasets] == ["a", "b"]


def test_eval_prompt_data_refuses_an_odd_count_and_bad_names():
    with pytest.raises(SystemExit, match="--eval-prompt-data takes one PATH or NAME PATH pairs; got 3 values: a a.jsonl b"):
        _cli("--eval-prompt-data", "a", "a.jsonl", "b")
    # two paths (no names) read as one pair whose name is a path
    with pytest.raises(ValueError, match="eval dataset name 'a.jsonl'"):
        _cli("--eval-prompt-data", "a.jsonl", "b.jsonl")
    with pytest.raises(ValueError, match="repeated: a"):
        _cli("--eval-prompt-data", "a", "1.jsonl", "a", "2.jsonl")


# -------------------------------------------------------------------------------------- rows


def test_eval_row_puts_the_first_dataset_under_plain_keys():
    per_dataset = {
        "gsm8k": {"accuracy": 0.5, "pass@1": 0.5, "pass@2": 0.75, "num_prompts": 4.0, "weight_version": 3.0},
        "toy": {"accuracy": 0.25, "pass@1": 0.25, "num_prompts": 8.0, "weight_version": 3.0},
    }
    assert eval_row(per_dataset, named=True) == {
        "accuracy": 0.5, "pass@1": 0.5, "pass@2": 0.75, "num_prompts": 4.0, "weight_version": 3.0,
        "gsm8k/accuracy": 0.5, "gsm8k/pass@1": 0.5, "gsm8k/pass@2": 0.75, "gsm8k/num_prompts": 4.0,
        "toy/accuracy": 0.25, "toy/pass@1": 0.25, "toy/num_prompts": 8.0,
    }
    # the implicit dataset of a plain [eval]: the row is what it always was
    assert eval_row({"heldout": per_dataset["toy"]}, named=False) == per_dataset["toy"]
    with pytest.raises(ValueError, match="no datasets"):
        eval_row({}, named=True)


# ---------------------------------------------------------------------------- real evaluation


def _session(model_dir, tmp_path, eval_cfg):
    from miles_core.run import RunSession, prepare_run

    cfg = RunConfig.model_validate({
        "name": "eval-datasets",
        "model": {"path": str(model_dir)},
        "data": {"type": "toy", "num_prompts": 32},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 2, "rollout_max_response_len": 5},
        "eval": eval_cfg,
        "storage": {"root": f"memory://eval-datasets-{uuid.uuid4().hex}"},
    })
    return RunSession(cfg, prepare_run(cfg, log=lambda *_: None))


def _write_qa(tmp_path, n: int):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(n)))
    return path


def _eval_jsonl(session) -> list[dict]:
    return session.layout.read_jsonl("eval.jsonl")


def test_an_evaluation_covers_every_dataset_with_its_own_settings(tiny_model_dir, tmp_path):
    qa = _write_qa(tmp_path, 3)
    code = f"{__name__}:response_code"
    toy = {"name": "toy", "data": {"type": "toy"}, "num_prompts": 5, "n_samples_per_prompt": 4,
           "temperature": 1.0, "max_response_len": 3, "reward": code}
    named = _session(tiny_model_dir, tmp_path, {"num_prompts": 8, "datasets": [toy, {
        "name": "qa", "data": {"type": "file", "path": str(qa), "input_key": "question", "label_key": "answer"},
        "reward": f"{__name__}:always_right"}]})
    # the same toy evaluation, as the one implicit dataset of a plain [eval]
    plain = _session(tiny_model_dir, tmp_path, {"num_prompts": 5, "n_samples_per_prompt": 4, "temperature": 1.0,
                                                "max_response_len": 3, "reward": code})
    try:
        assert named.check_data()["eval_prompts"] == 5 + 3, "the total over the datasets (qa has only 3 rows)"
        row = named.evaluate(step=0)
        reference = plain.evaluate(step=0)
        assert _eval_jsonl(named) == [row], "the row is recorded as returned"
    finally:
        named.close()
        plain.close()

    assert (row["toy/num_prompts"], row["qa/num_prompts"]) == (5.0, 3.0)
    # pass@k up to each dataset's own samples per prompt: 4 for toy, eval's 1 for qa
    assert {k for k in row if k.startswith("toy/pass@")} == {"toy/pass@1", "toy/pass@2", "toy/pass@4"}
    assert {k for k in row if k.startswith("qa/pass@")} == {"qa/pass@1"}
    # each dataset scored by its own reward: qa's marks everything right, toy's never does
    assert row["qa/accuracy"] == row["qa/reward_mean"] == 1.0
    assert row["toy/accuracy"] == 0.0 and 0.0 < row["toy/reward_mean"] < 1.0
    assert row["toy/response_len_mean"] <= 3, "toy's own max_response_len"
    # the plain keys are the first dataset's metrics
    toy_metrics = {k.removeprefix("toy/"): v for k, v in row.items() if k.startswith("toy/")}
    assert {k: row[k] for k in toy_metrics} == toy_metrics
    assert "toy/weight_version" not in row and row["weight_version"] == 0.0
    assert {"step", "eval_seconds"} <= set(row) and "toy/step" not in row
    # and they are what the same settings give as the only dataset (per-dataset settings took effect)
    assert toy_metrics == {k: v for k, v in reference.items() if k not in ("step", "eval_seconds", "weight_version")}


def test_a_dataset_that_fails_to_load_is_named(tiny_model_dir, tmp_path):
    qa = _write_qa(tmp_path, 2)
    missing = tmp_path / "missing.jsonl"
    cases = [
        ({"name": "gone", "data": {"type": "file", "path": str(missing)}}, FileNotFoundError,
         rf"eval dataset 'gone' \({missing}\): dataset file not found"),
        ({"name": "keys", "data": {"type": "file", "path": str(qa)}}, ValueError,
         rf"eval dataset 'keys' \({qa}\): .*missing key 'prompt'"),
        ({"name": "small", "data": {"type": "toy", "max_operand": 3}, "num_prompts": 100}, ValueError,
         r"eval dataset 'small' \(toy task\): toy_problems: asked for 100 test problems"),
    ]
    for dataset, error, message in cases:
        session = _session(tiny_model_dir, tmp_path, {"num_prompts": 4, "datasets": [{"name": "ok", "data": {"type": "toy"}}, dataset]})
        try:
            with pytest.raises(error, match=message):
                session.check_data()
        finally:
            session.close()


def test_standalone_datasets_are_validated():
    from miles_core.eval.standalone import with_eval_datasets

    cfg = RunConfig.model_validate({"eval": {"data": {"type": "toy"}}})
    out = with_eval_datasets(cfg, [{"name": "bench", "data": {"type": "toy", "max_operand": 9}, "num_prompts": 4},
                                   EvalDatasetConfig(name="other", data={"type": "toy"})])
    assert out.eval.data is None and [d.name for d in out.eval.datasets] == ["bench", "other"]
    assert out.eval.datasets[0].data.max_operand == 9 and cfg.eval.datasets == []
    with pytest.raises(ValueError, match="repeated: bench"):
        with_eval_datasets(cfg, [{"name": "bench", "data": {"type": "toy"}}] * 2)
    with pytest.raises(ValueError, match="at least one dataset"):
        with_eval_datasets(cfg, [])
