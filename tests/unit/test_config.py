"""RunConfig, the command-line flags, shipped configs and light imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.cli import build_parser, resolve_config
from miles_core.config import (
    AsyncMode,
    DeepSpeedTrainerConfig,
    DrGRPOLossConfig,
    FileDataConfig,
    FullyAsyncMode,
    GRPOLossConfig,
    GSPOLossConfig,
    ModelConfig,
    ReinforcePPLossConfig,
    RunConfig,
    SyncMode,
    TorchTrainerConfig,
    ToyDataConfig,
)
from miles_core.miles_flags import FLAGS

REPO = Path(__file__).resolve().parents[2]


def _cfg(*argv: str) -> RunConfig:
    return resolve_config(build_parser().parse_args(["show-config", *argv]))


@pytest.mark.parametrize("module", ["miles_core.config", "miles_core.types", "miles_core.cli", "flows.train"])
def test_light_modules_import_without_heavy_backends(module):
    code = (
        f"import sys, {module}\n"
        "heavy = [m for m in ('torch', 'transformers', 'sglang', 'deepspeed', 'peft') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_help_path_imports_neither_torch_nor_prefect():
    code = (
        "import sys\n"
        "from deployments.cli import main\n"
        "try:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'prefect' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True)
    assert "--rollout-batch-size" in out.stdout and "--n-samples-per-prompt" in out.stdout


def test_flags_set_their_fields():
    cfg = _cfg(
        "--num-rollout", "7", "--rollout-batch-size", "16", "--n-samples-per-prompt", "4",
        "--global-batch-size", "32", "--rollout-max-response-len", "12", "--rollout-temperature", "0.7",
        "--lr", "3e-4", "--eval-interval", "none", "--kl-loss-type", "low_var_kl", "--kl-coef", "0.01",
        "--use-rollout-logprobs", "--no-rollout-shuffle", "--rollout-stop", "\n", "###",
    )
    assert (cfg.rollout.num_rollout, cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt) == (7, 16, 4)
    assert cfg.train.global_batch_size == 32 and cfg.train.lr == 3e-4
    assert cfg.rollout.rollout_max_response_len == 12 and cfg.rollout.rollout_temperature == 0.7
    assert cfg.eval.eval_interval is None  # "none" clears an optional field
    assert cfg.train.kl_type == "k3" and cfg.train.kl_coef == 0.01  # Miles' low_var_kl is k3
    assert cfg.train.kl_loss_coef == 0.0  # Miles' --kl-coef is the KL penalty in the reward, not the loss
    assert cfg.train.old_logprobs == "rollout"
    assert cfg.rollout.rollout_shuffle is False
    assert cfg.rollout.rollout_stop == ["\n", "###"]


def test_loss_flags_set_the_loss_union():
    # today's flags keep working and land in the default (grpo) variant
    cfg = _cfg("--eps-clip", "0.1", "--eps-clip-high", "0.28", "--eps-clip-c", "3", "--disable-grpo-std-normalization",
               "--entropy-coef", "0.01", "--kl-loss-coef", "0.02")
    loss = cfg.train.loss
    assert isinstance(loss, GRPOLossConfig) and (loss.eps_clip, loss.clip_high, loss.eps_clip_c) == (0.1, 0.28, 3.0)
    assert loss.advantage_std_normalize is False
    assert cfg.train.entropy_coef == 0.01 and cfg.train.kl_loss_coef == 0.02 and cfg.train.kl_coef == 0.0
    # --advantage-estimator picks the variant; the others' flags apply to it
    cfg = _cfg("--advantage-estimator", "gspo", "--eps-clip", "0.001")
    assert isinstance(cfg.train.loss, GSPOLossConfig) and cfg.train.loss.eps_clip == 0.001
    assert cfg.train.loss.clip_high == 4e-4  # the GSPO paper's default upper range stays
    assert isinstance(_cfg("--advantage-estimator", "reinforce_plus_plus").train.loss, ReinforcePPLossConfig)
    # dr_grpo's constant length is the rollout's generation budget unless set
    # (derived where the trainer takes it: the config keeps None, so it follows the rollout's length)
    cfg = _cfg("--advantage-estimator", "dr_grpo", "--rollout-max-response-len", "12")
    assert isinstance(cfg.train.loss, DrGRPOLossConfig) and cfg.train.loss.max_len is None
    assert cfg.trainer_config().loss.max_len == 12
    assert _cfg("--advantage-estimator", "dr_grpo", "--set", "train.loss.max_len=64").trainer_config().loss.max_len == 64


def test_flags_apply_to_the_file_as_written_so_nothing_derived_goes_stale(tmp_path):
    """A file with dr_grpo and 8-token responses, run with --rollout-max-response-len 512: Dr.GRPO's
    constant follows the flag (the file's config was once validated, filled in, re-dumped and the
    flag applied after, which kept 8)."""
    path = tmp_path / "run.toml"
    path.write_text('[rollout]\nrollout_max_response_len = 8\n[train.loss]\ntype = "dr_grpo"\n')
    assert RunConfig.from_toml(path).trainer_config().loss.max_len == 8
    cfg = _cfg("--config", str(path), "--rollout-max-response-len", "512")
    assert cfg.rollout.rollout_max_response_len == 512 and cfg.trainer_config().loss.max_len == 512
    assert cfg.train.loss.max_len is None  # validation wrote nothing into the config


def test_loss_config_is_validated(capsys):
    with pytest.raises(ValueError, match="eps_clip_c"):
        _cfg("--eps-clip-c", "1.0")  # the dual clip bound must be above 1
    with pytest.raises(SystemExit):
        _cfg("--advantage-estimator", "ppo")
    assert "invalid choice: 'ppo' (choose from 'grpo', 'dr_grpo', 'gspo'," in capsys.readouterr().err
    with pytest.raises(ValueError, match="advantage_std_normalize"):
        _cfg("--advantage-estimator", "dr_grpo", "--disable-grpo-std-normalization")  # dr_grpo has no std
    with pytest.raises(ValueError, match="entropy_coef"):
        RunConfig.model_validate({"train": {"entropy_coef": -0.1}})
    # a [train.loss] table without a type is the default variant
    assert RunConfig.model_validate({"train": {"loss": {"eps_clip": 0.3}}}).train.loss == GRPOLossConfig(eps_clip=0.3)


def test_prompt_data_flags_make_a_file_dataset_and_eval_inherits_keys():
    cfg = _cfg("--prompt-data", "gsm8k/train.jsonl", "--input-key", "question", "--label-key", "answer",
               "--eval-prompt-data", "gsm8k/test.jsonl", "--rm-type", "gsm8k")
    assert isinstance(cfg.data, FileDataConfig) and cfg.data.input_key == "question"
    assert isinstance(cfg.eval.data, FileDataConfig)
    assert (cfg.eval.data.path, cfg.eval.data.input_key, cfg.eval.data.label_key) == ("gsm8k/test.jsonl", "question", "answer")
    assert cfg.rollout.reward == "gsm8k"


def test_flags_of_a_kind_land_whatever_their_order():
    """A flag of a kind's settings given before the flag that picks the kind is kept (it was dropped
    when the kind's table started afresh after it)."""
    cfg = _cfg("--input-key", "question", "--prompt-data", "train.jsonl", "--eval-prompt-data", "test.jsonl")
    assert (cfg.data.path, cfg.data.input_key, cfg.eval.data.input_key) == ("train.jsonl", "question", "question")
    assert _cfg("--zero-stage", "3", "--train-backend", "deepspeed").train.backend.zero_stage == 3


def test_flags_override_toml_and_set_reaches_any_field(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('name = "x"\n[rollout]\nrollout_batch_size = 8\nnum_rollout = 3\n[train]\nlr = 0.1\n')
    cfg = _cfg("--config", str(path), "--rollout-batch-size", "16", "--set", "train.clip_grad=0.5",
               "--set", "model.tiny.hidden_size=64")
    assert cfg.name == "x" and cfg.rollout.num_rollout == 3 and cfg.train.lr == 0.1
    assert cfg.rollout.rollout_batch_size == 16 and cfg.train.clip_grad == 0.5
    assert cfg.model.tiny.hidden_size == 64


def test_mode_flags_and_async_settings(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('mode = "sync"\n')
    cfg = _cfg("--config", str(path), "--mode", "async", "--update-weights-interval", "2")
    assert cfg.mode == AsyncMode(update_weights_interval=2)
    cfg = _cfg("--fully-async", "--async-max-concurrent-samples", "64", "--max-weight-staleness", "3",
               "--async-unused-samples-handler", "retry", "--partial-rollout", "--dynamic-sampling-filters",
               "nonzero_reward_std", "--async-submit-granularity", "sample")
    a = cfg.mode
    assert a.type == "fully_async" and a.max_concurrent_samples == 64 and a.max_weight_staleness == 3
    assert a.unused_samples_handler == "retry" and a.partial_rollout and a.dynamic_filters == ["nonzero_reward_std"]
    assert a.submit_granularity == "sample"
    # a mode's flag comes before or after the mode's: the same run
    assert _cfg("--async-max-concurrent-samples", "64", "--mode", "fully_async").mode.max_concurrent_samples == 64


def test_mode_is_a_tagged_union_each_mode_with_its_own_settings(tmp_path):
    """``mode = "async"`` is that mode's table with its defaults; a table sets its fields; a setting of
    another mode is refused naming it (in TOML, in Python, and by flag); switching the mode by flag
    starts the new mode's table afresh."""
    assert RunConfig.model_validate({"mode": "async"}).mode == AsyncMode()
    cfg = RunConfig.model_validate({"mode": {"type": "fully_async", "max_concurrent_samples": 8}})
    assert isinstance(cfg.mode, FullyAsyncMode) and cfg.mode.max_concurrent_samples == 8
    assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # what a run folder stores reads back
    with pytest.raises(ValueError, match="update_weights_interval"):
        RunConfig.model_validate({"mode": {"type": "fully_async", "update_weights_interval": 2}})
    cfg = cfg.updated({"mode": "sync"})  # an update takes a name too
    assert cfg.mode == SyncMode() and cfg.mode.type == "sync"
    with pytest.raises(TypeError, match="compare cfg.mode.type with 'sync'"):
        _ = cfg.mode == "sync"  # the old spelling would be silently False: it is loud instead
    with pytest.raises(ValueError, match="max_concurrent_samples"):
        cfg.updated({"mode": {"type": "sync", "max_concurrent_samples": 8}})
    with pytest.raises(SystemExit, match="--update-weights-interval is a setting of async mode, but this run's "
                                         "mode is 'fully_async': add --mode async"):
        _cfg("--fully-async", "--update-weights-interval", "2")
    with pytest.raises(SystemExit, match="--rollout-producers is a setting of fully_async mode.*add --fully-async"):
        _cfg("--rollout-producers", "2")
    with pytest.raises(SystemExit, match="disagree"):
        _cfg("--mode", "sync", "--fully-async")
    path = tmp_path / "run.toml"
    path.write_text('[mode]\ntype = "fully_async"\nmax_concurrent_samples = 8\n')
    assert _cfg("--config", str(path), "--async-submit-granularity", "sample").mode.max_concurrent_samples == 8
    assert _cfg("--config", str(path), "--mode", "async").mode == AsyncMode()  # another mode: its own defaults
    assert _cfg("--config", str(path), "--set", "mode.type=fully_async").mode.max_concurrent_samples == 8


def test_an_older_async_rollout_table_moves_into_its_mode(tmp_path):
    """Configs written before ``mode`` held its settings (``[async_rollout]``, stored run configs)
    still load; a setting the run's mode does not have is refused unless it is at its default."""
    cfg = RunConfig.model_validate({"mode": "fully_async", "async_rollout": {"max_weight_staleness": 3,
                                                                           "update_weights_interval": 1}})
    assert cfg.mode.max_weight_staleness == 3 and cfg.mode.max_concurrent_samples == 256
    old_dump = {"mode": "sync", "async_rollout": FullyAsyncMode().model_dump() | {"update_weights_interval": 1}}
    del old_dump["async_rollout"]["type"]
    assert RunConfig.model_validate(old_dump).mode == SyncMode()  # every setting at its default: nothing lost
    with pytest.raises(ValueError, match="async_rollout.max_concurrent_samples = 64 is a setting of mode "
                                         "'fully_async', but this run's mode is 'sync'"):
        RunConfig.model_validate({"async_rollout": {"max_concurrent_samples": 64}})
    with pytest.raises(ValueError, match="async_rollout.bogus: no such setting"):
        RunConfig.model_validate({"mode": "fully_async", "async_rollout": {"bogus": 1}})
    # a stored run's config (``miles evaluate`` of a run from before): what did nothing in it is let go
    from miles_core.config import upgrade_mode

    stored = {"mode": "sync", "async_rollout": {"max_concurrent_samples": 64, "update_weights_interval": 2}}
    assert RunConfig.model_validate(upgrade_mode(stored, strict=False)).mode == SyncMode()
    path = tmp_path / "old.toml"
    path.write_text('mode = "async"\n[async_rollout]\nupdate_weights_interval = 3\n')
    assert _cfg("--config", str(path)).mode == AsyncMode(update_weights_interval=3)
    with pytest.raises(ValueError, match="update_weights_interval = 3 is a setting of mode 'async', but this "
                                         "run's mode is 'fully_async'"):
        _cfg("--config", str(path), "--fully-async")  # the old table is one for every mode: nothing dropped unsaid
    path.write_text('[async_rollout]\nmax_concurrent_samples = 3\n')
    assert _cfg("--config", str(path), "--fully-async").mode.max_concurrent_samples == 3
    with pytest.raises(ValueError, match=f"{path}: async_rollout.max_concurrent_samples = 3"):
        _cfg("--config", str(path))


def test_async_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="buffer_capacity_factor"):
        RunConfig.model_validate({"mode": {"type": "fully_async", "buffer_capacity_factor": 0.5}})
    assert RunConfig.model_validate({"mode": "fully_async", "checkpoint": {"save_interval": 5}}).checkpoint.save_interval == 5
    with pytest.raises(ValueError, match="partial_rollout cannot continue samples of a custom generate"):
        RunConfig.model_validate({"mode": {"type": "fully_async", "partial_rollout": True},
                                  "rollout": {"custom_generate_function_path": "m:f"}})
    with pytest.raises(ValueError, match="custom_generate_function_path.*instead"):
        RunConfig.model_validate({"mode": "fully_async", "rollout": {"rollout_function_path": "m:f"}})


def test_bad_config_errors_name_the_file_and_field(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nlearning_rate = 0.1\n")
    with pytest.raises(ValueError, match=r"bad\.toml.*\n(.|\n)*train\.learning_rate"):
        RunConfig.from_toml(path)
    path.write_text("[train\n")
    with pytest.raises(ValueError, match="bad.toml: not valid TOML"):
        RunConfig.from_toml(path)
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        RunConfig.from_toml(tmp_path / "missing.toml")


def test_file_flags_without_a_file_dataset_are_refused():
    with pytest.raises(SystemExit, match="--prompt-data"):
        _cfg("--input-key", "question")


def test_global_batch_must_divide_the_rollout_batch():
    with pytest.raises(ValueError, match="global_batch_size=48 must divide"):
        RunConfig.model_validate({"rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 8}, "train": {"global_batch_size": 48}})


def test_every_flag_points_at_a_documented_field():
    from miles_core.cli import _field

    for flag, path in FLAGS.items():
        info = _field(path)  # raises on a path that names no field
        assert info.description, f"{flag} -> {path} has no docstring, so no --help text"


def test_public_dict_drops_storage_secrets():
    cfg = RunConfig.model_validate({"storage": {"root": "s3://b/runs", "storage_options": {"secret": "hunter2"}}})
    assert "hunter2" not in str(cfg.public_dict()) and "hunter2" not in repr(cfg)
    assert isinstance(RunConfig().data, ToyDataConfig)


def test_public_dict_redacts_every_datasets_storage_options():
    secret = {"key": "AKIA", "secret": "hunter2"}
    cfg = RunConfig.model_validate({
        "data": {"type": "file", "path": "s3://b/train.jsonl", "storage_options": secret},
        "eval": {"datasets": [{"name": "a", "data": {"type": "file", "path": "s3://b/a.jsonl", "storage_options": secret}},
                              {"name": "b", "data": {"type": "toy"}}]},
    })
    public = cfg.public_dict()
    assert "hunter2" not in str(public)
    assert public["eval"]["datasets"][0]["data"]["storage_options"] == "<redacted>"
    assert public["data"]["storage_options"] == "<redacted>"
    cfg = RunConfig.model_validate({"eval": {"data": {"type": "file", "path": "s3://b/t.jsonl", "storage_options": secret}}})
    assert "hunter2" not in str(cfg.public_dict())


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_parse(path):
    RunConfig.from_toml(path)


def test_config_reference_is_current():
    from miles_core.config_doc import config_markdown

    doc = (REPO / "docs" / "config.md").read_text()
    assert doc == config_markdown(), "docs/config.md is stale: run `miles config-doc > docs/config.md`"


def test_loss_settings_of_older_configs_say_where_they_moved(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("[train]\neps_clip = 0.2\nloss_reducer = 'token_mean'\n")
    with pytest.raises(ValueError, match=r"(?s)old.toml.*moved to the \[train.loss\] table: train.eps_clip -> "
                                         r"train.loss.eps_clip, train.loss_reducer -> train.loss.reducer"):
        RunConfig.from_toml(path)


# ------------------------------------------------------------------------------ trainer backend


def test_deepspeed_flags_set_the_backend_union(tmp_path):
    cfg = _cfg("--train-backend", "deepspeed", "--zero-stage", "3", "--deepspeed-precision", "bf16",
               "--trainer-processes", "2", "--trainer-launcher", "deepspeed")
    backend = cfg.train.backend
    assert isinstance(backend, DeepSpeedTrainerConfig)
    assert (backend.zero_stage, backend.precision, backend.num_processes, backend.launcher) == (3, "bf16", 2, "deepspeed")
    assert (backend.device, backend.dist_backend, backend.config_overrides) == ("cpu", None, {})
    assert isinstance(_cfg().train.backend, TorchTrainerConfig)
    # a file that picks deepspeed; --train-backend torch drops its DeepSpeed-only settings
    path = tmp_path / "ds.toml"
    path.write_text('[train.backend]\ntype = "deepspeed"\nzero_stage = 1\ndevice = "cpu"\n')
    assert RunConfig.from_toml(path).train.backend.zero_stage == 1
    assert isinstance(_cfg("--config", str(path), "--train-backend", "torch").train.backend, TorchTrainerConfig)
    assert _cfg("--config", str(path), "--zero-stage", "0").train.backend.zero_stage == 0


def test_bad_deepspeed_settings_are_refused():
    with pytest.raises(SystemExit, match="--zero-stage configure the DeepSpeed trainer.*add --train-backend deepspeed"):
        _cfg("--zero-stage", "3")
    bad_flags = {"zero_stage": ["--zero-stage", "4"], "precision": ["--deepspeed-precision", "fp16"],
                 "num_processes": ["--trainer-processes", "0"], "launcher": ["--trainer-launcher", "mpirun"]}
    for field, flags in bad_flags.items():
        with pytest.raises(ValueError, match=f"train.backend.deepspeed.{field}"):
            _cfg("--train-backend", "deepspeed", *flags)
    with pytest.raises(ValueError, match=r"may not set keys .*gradient_clipping \(set train.clip_grad\), "
                                         r"zero_optimization.stage \(set train.backend.zero_stage\)"):
        DeepSpeedTrainerConfig(config_overrides={"gradient_clipping": 2.0, "zero_optimization": {"stage": 3}})
    DeepSpeedTrainerConfig(config_overrides={"zero_optimization": {"reduce_bucket_size": 1e6}})  # allowed
    with pytest.raises(ValueError, match="runs on 'cpu' or 'cuda'"):
        DeepSpeedTrainerConfig(device="mps")
    with pytest.raises(ValueError, match="names one device but num_processes=2"):
        DeepSpeedTrainerConfig(device="cuda:1", num_processes=2)


# ------------------------------------------------------------------------------------ multi-LoRA


def test_multi_lora_flags_and_adapter_configs():
    cfg = _cfg("--lora-rank", "4", "--lr", "1e-3", "--lora-count", "3", "--multi-lora-rollout-source", "per_adapter")
    assert cfg.multi_lora.n_adapters == 3 and cfg.multi_lora.rollout_source == "per_adapter"
    adapters = cfg.adapter_configs()
    assert list(adapters) == ["adapter-0", "adapter-1", "adapter-2"]
    for name, acfg in adapters.items():
        assert acfg.lora.adapter_name == name and acfg.lora.rank == 4 and acfg.train.lr == 1e-3
        assert acfg.mode.type == "fully_async" and acfg.multi_lora is None
        assert acfg.train.use_tis is False  # per-adapter samples are on-policy for their adapter
    assert _cfg("--lora-rank", "4", "--multi-lora-n-adapters", "2").multi_lora.names == ["adapter-0", "adapter-1"]
    assert cfg.multi_lora.shared_base is True  # one base for every adapter, unless turned off
    assert _cfg("--lora-rank", "4", "--lora-count", "2", "--no-multi-lora-shared-base").multi_lora.shared_base is False


def test_multi_lora_adapter_overrides_are_merged_and_validated():
    raw = {"lora": {"rank": 4, "dropout": 0.1}, "train": {"lr": 1e-4, "kl_coef": 0.01},
           "checkpoint": {"save_interval": 2},
           "multi_lora": {"lead_adapter": "wide", "adapters": [
               {"name": "wide", "lora": {"rank": 16}, "train": {"lr": 3e-3}},
               {"name": "gspo", "train": {"loss": {"type": "gspo"}, "use_tis": False}}]}}
    adapters = RunConfig.model_validate(raw).adapter_configs()
    wide, gspo = adapters["wide"], adapters["gspo"]
    assert (wide.lora.rank, wide.lora.dropout, wide.train.lr, wide.train.kl_coef) == (16, 0.1, 3e-3, 0.01)
    assert wide.train.use_tis is True  # shared mode: the behaviour policy is not the adapter
    assert gspo.train.loss.type == "gspo" and gspo.train.use_tis is False and gspo.train.lr == 1e-4
    # the run saves each adapter's trainer itself; the adapters' own configs do not checkpoint
    assert wide.checkpoint.save_interval is None

    def refused(multi_lora, match, **extra):
        with pytest.raises(ValueError, match=match):
            RunConfig.model_validate({"lora": {"rank": 4}, "multi_lora": multi_lora, **extra})

    refused({"n_adapters": 2, "adapters": [{"name": "x"}]}, "either n_adapters .* or an adapters list")
    refused({}, "either n_adapters")
    refused({"adapters": [{"name": "a1"}, {"name": "a1"}]}, "names must be unique; repeated: a1")
    refused({"adapters": [{"name": "a/b"}]}, "adapter name 'a/b'")
    refused({"adapters": [{"name": "lr-0.003"}]}, "adapter name 'lr-0.003'")  # a torch module name in PEFT
    refused({"adapters": [{"name": "a1", "lora": {"adapter_name": "zz"}}]}, "the adapter's name is its `name`")
    refused({"adapters": [{"name": "a1", "lora": {"rnak": 3}}]}, "(?s)adapter 'a1'.*lora.rnak")
    refused({"adapters": [{"name": "a1", "train": {"loss": {"type": "ppo"}}}]}, "(?s)adapter 'a1'.*train.loss")
    refused({"n_adapters": 2, "lead_adapter": "x"}, "lead_adapter 'x' is not one of")
    refused({"n_adapters": 2, "rollout_source": "per_adapter", "lead_adapter": "adapter-0"}, "only applies to")
    with pytest.raises(ValueError, match="needs the adapters' base LoRA settings"):
        RunConfig.model_validate({"multi_lora": {"n_adapters": 2}})


def test_a_multi_lora_run_is_fully_async():
    raw = {"lora": {"rank": 4}, "multi_lora": {"n_adapters": 2}}
    for mode in (None, "sync", {"type": "async"}):
        cfg = RunConfig.model_validate(raw if mode is None else {**raw, "mode": mode})
        assert cfg.mode == FullyAsyncMode(), mode  # a mode named alone does not apply: documented
    with pytest.raises(ValueError, match="a multi-LoRA run is fully async: mode.update_weights_interval"):
        RunConfig.model_validate({**raw, "mode": {"type": "async", "update_weights_interval": 2}})
    assert RunConfig.model_validate(raw).updated({"mode": "sync"}).mode == FullyAsyncMode(), "an update too"
    with pytest.raises(SystemExit, match="--mode async: a multi-LoRA run is always fully async"):
        _cfg("--lora-rank", "4", "--lora-count", "2", "--mode", "async")


def test_in_run_evaluation_settings():
    cfg = _cfg("--eval-engine", "separate", "--eval-max-in-flight", "2", "--eval-overflow", "skip")
    assert (cfg.eval.engine, cfg.eval.max_in_flight, cfg.eval.overflow) == ("separate", 2, "skip")
    assert RunConfig().eval.engine == "separate" and RunConfig().eval.overflow == "backpressure"
    with pytest.raises(ValueError, match="eval.max_in_flight"):
        _cfg("--eval-max-in-flight", "0")
    # a rollout engine that is a running server holds one version: evaluation needs its own engine
    server = {"engine": {"type": "sglang", "url": "http://127.0.0.1:30000"}}
    with pytest.raises(ValueError, match="set eval.engine_config .* or eval.engine = 'shared'"):
        RunConfig.model_validate(server)
    RunConfig.model_validate({**server, "eval": {"engine": "shared"}})
    RunConfig.model_validate({**server, "eval": {"engine_config": {"type": "sglang", "url": "http://127.0.0.1:30001"}}})


def test_every_count_size_length_and_rate_has_a_bound():
    """A bad number fails when the config is built, naming the field, not steps later (a
    ``ZeroDivisionError`` at step 1, a run that trains nothing, NaN losses)."""
    import inspect
    import typing

    import annotated_types as at
    import pydantic

    from miles_core import config

    unbounded = []
    for cname, model in inspect.getmembers(config, inspect.isclass):
        if not issubclass(model, pydantic.BaseModel) or not model.__module__.startswith(f"{config.__name__}."):
            continue
        for name, f in model.model_fields.items():
            args = typing.get_args(f.annotation) or (f.annotation,)
            items = [i for a in args for i in (typing.get_args(a) if typing.get_origin(a) is list else ())]
            numbers = [a for a in (*args, *items) if a in (int, float)]
            if numbers and not any(isinstance(m, (at.Ge, at.Gt, at.Le, at.Lt, at.Interval)) for m in f.metadata):
                unbounded.append(f"{cname}.{name}")
    assert not unbounded, f"numeric config fields without a bound: {unbounded}"


@pytest.mark.parametrize("field, value, message", [
    ("rollout.num_rollout", 0, "greater than or equal to 1"),
    ("rollout.num_rollout", -3, "greater than or equal to 1"),
    ("train.micro_batch_size", 0, "greater than or equal to 1"),
    ("train.lr", -1e-4, "greater than 0"),
    ("rollout.rollout_max_response_len", 0, "greater than or equal to 1"),
    ("rollout.rollout_top_p", 1.5, "less than or equal to 1"),
    ("rollout.rollout_stop_token_ids", [-1], "greater than or equal to 0"),
])
def test_out_of_range_numbers_are_refused_naming_the_field(field, value, message):
    table, key = field.split(".")
    with pytest.raises(ValueError) as error:
        RunConfig.model_validate({table: {key: value}})
    assert field in str(error.value) and message in str(error.value), str(error.value)


def test_secret_storage_options_never_reach_json_but_stay_in_python():
    """What Prefect stores (flow-run parameters: the config's JSON form) holds no credentials; the
    run's own objects, and a child process's stdin (``WITH_SECRETS``), keep them."""
    import json

    from fastapi.encoders import jsonable_encoder  # what Prefect serialises flow-run parameters with

    from miles_core.config import WITH_SECRETS

    options = {"endpoint_url": "http://s3.local", "key": "AKIA-1", "secret": "s3cr3t", "use_listings_cache": False,
               "client_kwargs": {"aws_session_token": "tok-1", "region_name": "eu"}}
    cfg = RunConfig.model_validate({"storage": {"root": "s3://b/runs", "storage_options": options},
                                    "data": {"type": "file", "path": "s3://b/d.jsonl",
                                             "storage_options": {"password": "pw-1", "anon": False}}})
    for text in (json.dumps(jsonable_encoder(cfg)), cfg.model_dump_json(), json.dumps(cfg.model_dump(mode="json"))):
        assert not any(s in text for s in ("AKIA-1", "s3cr3t", "tok-1", "pw-1")), text
        assert "http://s3.local" in text and '"region_name": "eu"' in text.replace('":"', '": "')
    assert cfg.storage.storage_options == options and cfg.data.storage_options["password"] == "pw-1"
    again = RunConfig.model_validate(json.loads(cfg.model_dump_json(context=WITH_SECRETS)))
    assert again.storage.storage_options == options


@pytest.mark.parametrize(("flags", "expected"), [
    ((), False),
    (("--mode", "async"), True),
    (("--mode", "fully_async"), True),
    (("--mode", "async", "--use-rollout-logprobs"), False),  # no recomputed denominator: no correction
    (("--mode", "async", "--no-use-tis"), False),
    (("--use-tis",), True),
])
def test_tis_is_on_by_default_in_the_async_modes_only(flags, expected):
    cfg = _cfg(*flags)
    assert cfg.trainer_config().use_tis is expected
    assert cfg.train.use_tis is (None if not {"--use-tis", "--no-use-tis"} & set(flags) else expected)


def test_a_config_is_frozen_and_an_update_meets_the_whole_runs_rules():
    """``cfg.rollout.rollout_batch_size = 7`` beside ``global_batch_size = 64`` was once accepted: a
    config is frozen now, and ``updated`` makes a new one validated whole (a copy, pickled or
    deep-copied, is equal and frozen too)."""
    import copy
    import pickle

    from pydantic import ValidationError

    cfg = RunConfig.model_validate({"rollout": {"rollout_batch_size": 8, "n_samples_per_prompt": 8},
                                    "train": {"global_batch_size": 64}})
    with pytest.raises(ValidationError, match="frozen"):
        cfg.rollout.rollout_batch_size = 16
    with pytest.raises(ValueError, match="global_batch_size=64 must divide the rollout batch"):
        cfg.updated({"rollout.rollout_batch_size": 7})
    with pytest.raises(ValueError, match="must divide"):
        cfg.updated({"train": {"global_batch_size": 48}})
    bigger = cfg.updated({"rollout.rollout_batch_size": 16})  # 128 samples: two optimizer steps of 64
    assert bigger.train.minibatch_sizes(128) == [64, 64] and cfg.rollout.rollout_batch_size == 8
    assert bigger.train == cfg.train and bigger.rollout.n_samples_per_prompt == 8, "the rest is kept"
    for other in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert other == cfg
        with pytest.raises(ValidationError, match="frozen"):
            other.rollout.n_samples_per_prompt = 3
    assert RunConfig().rollout == RunConfig().rollout.model_copy() == type(RunConfig().rollout)()


def test_prefect_yaml_parameters_are_valid_run_configs():
    """Every deployment's ``cfg`` in prefect.yaml validates as a RunConfig (the form a worker gets)."""
    import yaml

    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    with_cfg = [d for d in deployments if "cfg" in (d.get("parameters") or {})]
    assert len(with_cfg) >= 4
    for d in with_cfg:
        cfg = RunConfig.model_validate(d["parameters"]["cfg"])
        assert d["tags"][0] == "train" and (cfg.mode.type in d["tags"] or cfg.multi_lora is not None), d["name"]


def test_overrides_merge_into_a_config_table_by_table():
    """A deployment run's cfg on top of the served one (``flows.begin.deployment_config``): tables
    merge key by key, dotted keys reach into them, a table of another ``type`` replaces the old."""
    from miles_core.config import merge_overrides

    served = RunConfig.model_validate({"name": "served", "rollout": {"rollout_batch_size": 4},
                                       "train": {"lr": 3e-4, "loss": {"type": "grpo", "eps_clip": 0.1}}})
    merged = RunConfig.model_validate(merge_overrides(served.model_dump(mode="json"), {
        "rollout.num_rollout": 6, "train": {"loss": {"type": "dr_grpo"}}, "eval": {"num_prompts": 8}}))
    assert (merged.name, merged.rollout.rollout_batch_size, merged.rollout.num_rollout) == ("served", 4, 6)
    assert merged.train.lr == 3e-4 and isinstance(merged.train.loss, DrGRPOLossConfig)
    assert merged.train.loss.eps_clip == 0.2  # dr_grpo's own default, not grpo's 0.1 carried over
    assert merged.eval.num_prompts == 8 and merged.eval.eval_interval == served.eval.eval_interval
    assert RunConfig.model_validate({"rollout.num_rollout": 6, "train.lr": 0.01}).train.lr == 0.01


def test_serving_makes_relative_paths_absolute(tmp_path):
    from deployments.serve import absolute_paths

    cfg = RunConfig.model_validate({"data": {"type": "file", "path": "datasets/gsm8k/train.jsonl"},
                                    "eval": {"data": {"type": "file", "path": "s3://bucket/test.jsonl"}}})
    served = absolute_paths(cfg, tmp_path)
    assert served.data.path == str(tmp_path / "datasets/gsm8k/train.jsonl")
    assert served.model.cache_dir == str(tmp_path / ".cache/miles/models") and served.storage.root == str(tmp_path / "runs")
    assert served.eval.data.path == "s3://bucket/test.jsonl" and served.model.path == "builtin:tiny-addition"
    for name in ("smollm2-135m-instruct", "tiny-addition"):  # a model by name stays a name
        assert absolute_paths(cfg.model_copy(update={"model": ModelConfig(path=name)}), tmp_path).model.path == name
    folder = absolute_paths(cfg.model_copy(update={"model": ModelConfig(path="models/mine")}), tmp_path)
    assert folder.model.path == str(tmp_path / "models/mine")
