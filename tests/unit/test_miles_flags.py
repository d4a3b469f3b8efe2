"""Miles' flags on the ``miles`` command: every one is taken or refused with what to use instead,
none is read as an abbreviation of another, the few with a meaning of their own do what
docs/miles-flags.md says, and that page is current."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_core.cli import build_parser, resolve_config
from miles_core.miles_flags import MODE_FLAGS, flags_markdown, miles_flags, unsupported

REPO = Path(__file__).resolve().parents[2]


def _cfg(*argv: str):
    return resolve_config(build_parser().parse_args(["show-config", *argv]))


def _refusal(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        _cfg(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_every_miles_flag_is_taken_or_refused_with_a_hint(capsys):
    parser = build_parser()
    refused = [f for f in miles_flags() if unsupported(f) is not None]
    assert len(refused) > 250 and len(miles_flags()) - len(refused) > 60
    for flag in refused:
        with pytest.raises(SystemExit):
            parser.parse_args(["train", flag, "1"])
        err = capsys.readouterr().err
        assert f"{flag} is a Miles flag not supported here; {unsupported(flag)}" in err, flag
    # SGLang's own flags reach Miles as --sglang-<flag>: any of them gets the SGLang hint
    assert "start SGLang with it" in _refusal(capsys, "--sglang-mem-fraction-static", "0.7")
    assert "unrecognized arguments: --no-such-flag" in _refusal(capsys, "--no-such-flag")


def test_no_flag_is_an_abbreviation_of_another(capsys):
    assert "unrecognized arguments: --save-interv" in _refusal(capsys, "--save-interv", "3")
    cfg = _cfg("--save", "/tmp/ckpt", "--save-interval", "5")  # Miles' --save is not --save-interval
    assert cfg.storage.root == "/tmp/ckpt" and cfg.checkpoint.save_interval == 5


def test_the_mode_documents_flags_are_listed_and_the_page_is_current():
    page = (REPO / "docs" / "miles-flags.md").read_text()
    assert page == flags_markdown(), "docs/miles-flags.md is stale: run `miles flags-doc > docs/miles-flags.md`"
    for flag in MODE_FLAGS:
        assert f"| `{flag}` |" in page.split("## Every Miles flag")[0], flag
    assert unsupported("--fully-async") is None and unsupported("--lora-count") is None


def test_use_kl_loss_needs_its_coefficient(capsys):
    with pytest.raises(SystemExit, match="--use-kl-loss needs --kl-loss-coef > 0"):
        _cfg("--use-kl-loss")
    assert _cfg("--use-kl-loss", "--kl-loss-coef", "0.01").train.kl_loss_coef == 0.01


def test_the_lr_schedule_flags_set_the_train_schedule():
    cfg = _cfg("--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--min-lr", "1e-6", "--lr", "1e-4",
               "--num-rollout", "10")
    assert (cfg.train.lr_decay_style, cfg.train.lr_warmup_steps, cfg.train.min_lr) == ("cosine", 5, 1e-6)
    trainer = cfg.trainer_config()  # the decay spans the run's optimizer steps unless --lr-decay-iters says
    assert trainer.lr_decay_steps == 10 * len(cfg.train.minibatch_sizes(cfg.samples_per_rollout))
    assert _cfg("--lr-decay-style", "linear", "--lr-decay-iters", "7").trainer_config().lr_decay_steps == 7
    with pytest.raises(ValueError, match="train.lr_decay_style"):
        _cfg("--lr-decay-style", "inverse-square-root")  # not a style here: the config refuses it, naming the field


def test_eval_keys_apply_to_every_held_out_file(tmp_path):
    cfg = _cfg("--prompt-data", "train.jsonl", "--input-key", "question", "--eval-prompt-data", "gsm8k", "a.jsonl",
               "math", "b.jsonl", "--eval-input-key", "problem", "--eval-label-key", "solution", "--eval-top-p", "0.9")
    assert [(d.data.input_key, d.data.label_key) for d in cfg.eval.datasets] == [("problem", "solution")] * 2
    assert cfg.data.input_key == "question"  # the training data keeps its own
    assert {d.top_p for d in cfg.eval.resolved(cfg.data, cfg.rollout)} == {0.9}
    with pytest.raises(SystemExit, match="add --eval-prompt-data"):
        _cfg("--eval-input-key", "problem")


def test_load_resumes_a_run_folder(tmp_path):
    run = tmp_path / "runs" / "gsm8k-grpo" / "20261204-0300"
    (run / "checkpoints").mkdir(parents=True)
    cfg = _cfg("--load", str(run))
    assert (cfg.storage.root, cfg.name, cfg.run_id) == (str(tmp_path / "runs"), "gsm8k-grpo", "20261204-0300")
    never_saved = tmp_path / "runs" / "other" / "20261204-0301"
    never_saved.mkdir(parents=True)
    with pytest.raises(SystemExit, match="no checkpoints to resume from"):
        _cfg("--load", str(never_saved))
    with pytest.raises(SystemExit, match="no such run folder"):
        _cfg("--load", str(tmp_path / "missing"))


def test_lora_count_on_train_runs_the_multi_lora_flow(monkeypatch, capsys):
    """``miles train --lora-rank 8 --lora-count 2`` trained one adapter once: it now goes to the
    multi-LoRA flow, as ``train-multi-lora`` does (the flows themselves are tested in integration)."""
    import flows.multi_lora
    import flows.train
    from deployments import cli

    called = []
    monkeypatch.setattr(flows.multi_lora, "train_multi_lora", lambda cfg: called.append(("multi", cfg)) or {})
    monkeypatch.setattr(flows.train, "train", lambda cfg: called.append(("one", cfg)) or {})
    monkeypatch.setattr(cli, "format_multi_lora_summary", lambda s: "multi")
    monkeypatch.setattr(cli, "format_summary", lambda s: "one")
    cli._train("train", _cfg("--lora-rank", "8", "--lora-count", "2"))
    cli._train("train", _cfg("--lora-rank", "8"))
    assert [kind for kind, _ in called] == ["multi", "one"]
    assert len(called[0][1].multi_lora.names) == 2 and called[1][1].multi_lora is None


def test_rollout_seed_is_the_runs_seed():
    assert _cfg("--rollout-seed", "7").seed == 7


def test_num_epoch_sets_the_runs_length_from_the_datasets_prompts(tmp_path, capsys):
    assert _cfg("--num-epoch", "2", "--rollout-batch-size", "64").rollout.num_rollout == 2 * 4096 // 64  # toy
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "label": "{i + 1}"}}\n' for i in range(10)))
    cfg = _cfg("--prompt-data", str(data), "--num-epoch", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
               "--lr-decay-style", "cosine")
    assert cfg.rollout.num_rollout == 7  # 30 prompts // 4, Miles' rule
    assert "10 prompts x 3 // 4 per rollout = 7 rollouts" in capsys.readouterr().err
    per_rollout = len(cfg.train.minibatch_sizes(cfg.samples_per_rollout))
    assert cfg.trainer_config().lr_decay_steps == 7 * per_rollout  # the schedule follows the run's length
    with pytest.raises(SystemExit, match="--num-epoch and --num-rollout both set the run's length"):
        _cfg("--num-epoch", "1", "--num-rollout", "5")
    with pytest.raises(SystemExit, match="less than one rollout batch of 32"):
        _cfg("--prompt-data", str(data), "--num-epoch", "1")


def test_an_invalid_value_is_blamed_on_where_it_was_set(tmp_path):
    """A bad flag is named as the flag, not as an error in the config file beside it."""
    config = tmp_path / "run.toml"
    config.write_text("[rollout]\nrollout_batch_size = 4\nn_samples_per_prompt = 2\n")
    with pytest.raises(ValueError, match=r"^--n-samples-per-prompt 0: invalid run config:\n(?s:.*)rollout.n_samples_per_prompt"):
        _cfg("--config", str(config), "--n-samples-per-prompt", "0")
    with pytest.raises(ValueError, match=r"^--global-batch-size 7: invalid run config:"):
        _cfg("--config", str(config), "--global-batch-size", "7")
    with pytest.raises(ValueError, match=r"^--set rollout.n_samples_per_prompt=0: invalid run config:"):
        _cfg("--config", str(config), "--set", "rollout.n_samples_per_prompt=0")
    with pytest.raises(ValueError, match=r"^--no-progress-seconds 0.0: invalid run config:"):
        _cfg("--fully-async", "--no-progress-seconds", "0")
    config.write_text("[rollout]\nrollout_batch_size = 0\n")
    with pytest.raises(ValueError, match=rf"^{config}: invalid run config:"):
        _cfg("--config", str(config), "--n-samples-per-prompt", "2")
