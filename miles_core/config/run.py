"""``RunConfig``: the whole run, the one object a run is built from.

The same model is the Prefect flow parameter (the UI form), the TOML config file and the target
of the ``miles`` command-line flags (which keep Miles' names, see ``miles_core.cli``). Its tables
are in ``miles_core.config.schema``. It is changed by copying: ``updated(overrides)`` merges
overrides (``miles_core.config.overrides``) and validates the result whole. A raw config is read in
today's shape first (``miles_core.config.migrations``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, model_validator

from miles_core.config.forms import run_form
from miles_core.config.migrations import upgrade_mode
from miles_core.config.overrides import expand_dotted, merge_overrides
from miles_core.config.schema import (
    CheckpointConfig,
    DataConfig,
    DrGRPOLossConfig,
    EngineConfig,
    EvalConfig,
    HFEngineConfig,
    LoraConfig,
    ModeConfig,
    ModelConfig,
    MultiLoraConfig,
    ResourcesConfig,
    RolloutConfig,
    StorageConfig,
    SyncMode,
    ToyDataConfig,
    TrackingConfig,
    TrainConfig,
    _Base,
)
from miles_core.config.secrets import REDACTED, dataset_tables


class RunConfig(_Base):
    """A whole training run."""

    model_config = ConfigDict(**{**_Base.model_config, "json_schema_extra": run_form})

    # the order of the UI's form: what a run is, then the rest
    name: str = "toy-addition"
    """Run name; the run folder is ``<storage.root>/<name>/<run_id>``."""
    mode: ModeConfig = Field(default_factory=SyncMode)
    """Execution mode and its own settings, by ``type``: ``sync`` (rollout k, then train k, then push
    weights k), ``async`` (rollout k+1 runs while train k does) or ``fully_async`` (producers
    generate for the whole run into the sample stream and the trainer consumes from it). In TOML
    ``mode = "async"`` is that mode with its defaults; ``[mode]`` with ``type = "..."`` sets its
    fields too."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=ToyDataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run_id: str | None = None
    """Run id (None: a fresh timestamped id). An existing run with a checkpoint resumes from it."""
    seed: int = Field(default=0, ge=0)
    """Seed of prompt order and sampling."""
    engine: EngineConfig = Field(default_factory=HFEngineConfig)
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of the full policy (None: full fine-tuning)."""
    multi_lora: MultiLoraConfig | None = None
    """Train several LoRA adapters over one rollout stream (``miles train-multi-lora``; None: one policy).
    Such a run is always fully async (a ``mode`` given as a name becomes ``fully_async``);
    ``checkpoint.save_interval`` saves each adapter (its trainer and its cursors) under
    ``adapters/<name>/checkpoints``, and the same run id resumes every adapter from its own."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)

    @model_validator(mode="before")
    @classmethod
    def _dotted_keys(cls, data: Any) -> Any:
        """``{"rollout.num_rollout": 6}`` is ``{"rollout": {"num_rollout": 6}}`` (deployment parameters,
        the API); ``mode = "sync"`` is ``[mode] type = "sync"``, an older ``[async_rollout]`` table moves
        into ``mode`` (``upgrade_mode``)."""
        if isinstance(data, dict) and any(isinstance(k, str) and "." in k for k in data):
            data = expand_dotted(data)
        return upgrade_mode(data)

    @model_validator(mode="after")
    def _check_batches(self) -> RunConfig:
        samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        gbs = self.train.global_batch_size
        if gbs is not None and samples % gbs:
            raise ValueError(
                f"train.global_batch_size={gbs} must divide the rollout batch "
                f"(rollout_batch_size * n_samples_per_prompt = {samples} samples)"
            )
        self.train.minibatch_sizes(samples)  # global_batch_size and num_steps_per_rollout agree
        if getattr(self.mode, "partial_rollout", False) and self.rollout.custom_generate_function_path:
            raise ValueError(
                "mode.partial_rollout cannot continue samples of a custom generate function "
                "(rollout.custom_generate_function_path); turn one of them off"
            )
        if self.multi_lora is not None:
            self._check_multi_lora()
        if self.eval.engine == "separate" and self.eval.engine_config is None and getattr(self.engine, "url", None):
            raise ValueError(
                f"eval.engine = 'separate' needs an evaluation engine of its own, but the rollout engine is the "
                f"server at {self.engine.url}: set eval.engine_config (e.g. another server's url) or eval.engine = 'shared'"
            )
        if self.mode.type == "fully_async" and self.rollout.rollout_function_path:
            raise ValueError(
                "rollout.rollout_function_path replaces the rollout step of sync and async modes; in "
                "fully_async mode use rollout.custom_generate_function_path (per sample) instead"
            )
        return self

    def updated(self, overrides: dict[str, Any]) -> RunConfig:
        """A new config: this one with ``overrides`` on top (``merge_overrides``: dotted keys such as
        ``{"rollout.num_rollout": 6}`` reach into tables), validated whole."""
        return RunConfig.model_validate(merge_overrides(self.model_dump(), overrides))

    def _check_multi_lora(self) -> None:
        if self.lora is None:
            raise ValueError("multi_lora needs the adapters' base LoRA settings: a [lora] section or --lora-rank R")
        if self.rollout.rollout_function_path:
            raise ValueError("multi_lora runs generate with the fully-async producer: rollout.rollout_function_path "
                             "does not apply (use rollout.custom_generate_function_path)")
        ml = self.multi_lora
        if self.mode.type != "fully_async":
            raise ValueError(f"a multi-LoRA run is fully async, but mode is {self.mode.type!r}: set mode = 'fully_async'")
        if ml.rollout_source == "shared" and len(ml.names) > 1 and self.mode.unused_samples_handler == "retry":
            raise ValueError(
                "mode.unused_samples_handler = 'retry' does not apply to shared multi-LoRA rollouts: a group "
                "one adapter rejects as stale would be generated again for every adapter, and the others, which "
                "trained it, would train its prompt twice; use 'drop' (the default) or rollout_source = 'per_adapter'"
            )
        self.adapter_configs()  # every adapter's overrides make a valid config

    def trainer_config(self) -> TrainConfig:
        """``train`` as the trainer takes it, what this run decides filled in (the config itself is
        never written to): ``use_tis`` None decided for the mode (on in the async modes with
        recomputed old logprobs, else off); Dr.GRPO's ``max_len`` None is the generation budget,
        ``rollout.rollout_max_response_len``."""
        update: dict[str, Any] = {}
        if self.train.use_tis is None:
            update["use_tis"] = self.mode.type != "sync" and self.train.old_logprobs == "recompute"
        if isinstance(self.train.loss, DrGRPOLossConfig) and self.train.loss.max_len is None:
            update["loss"] = self.train.loss.model_copy(update={"max_len": self.rollout.rollout_max_response_len})
        if self.train.lr_decay_steps is None and self.train.lr_decay_style != "constant":
            per_rollout = len(self.train.minibatch_sizes(self.samples_per_rollout))
            update["lr_decay_steps"] = self.rollout.num_rollout * per_rollout
        return self.train.model_copy(update=update) if update else self.train

    def adapter_configs(self) -> dict[str, RunConfig]:
        """Each adapter's own run config (multi-LoRA): this one with the adapter's LoRA and train
        overrides, ``lora.adapter_name`` = its name, fully-async mode, no ``multi_lora``; in shared
        mode ``train.use_tis`` defaults to on. Errors name the adapter and the field."""
        assert self.multi_lora is not None and self.lora is not None
        base = self.model_dump()
        base["multi_lora"] = None  # its mode is fully async already
        # the multi-LoRA run saves and resumes each adapter itself (flows/multi_lora.py)
        base["checkpoint"] = {**base["checkpoint"], "save_interval": None}
        configs = {}
        for spec in self.multi_lora.specs:
            raw = dict(base)
            raw["lora"] = {**base["lora"], **spec.lora, "adapter_name": spec.name}
            train = {**base["train"]}
            if self.multi_lora.rollout_source == "shared":
                train["use_tis"] = True
            elif train["use_tis"] is None:  # per adapter: each adapter generates its own samples
                train["use_tis"] = False
            train.update(spec.train)
            raw["train"] = train
            try:
                configs[spec.name] = RunConfig.model_validate(raw)
            except ValidationError as e:
                raise ValueError(f"multi_lora adapter {spec.name!r}: its overrides make an invalid config:\n{e}") from None
        return configs

    def engines_tie_weights(self) -> bool:
        """Whether every engine of the run ties a snapshot's ``lm_head.weight`` to its embeddings on load
        (the transformers engine does), so snapshots store a tied head once. Servers get it written out."""
        engines = [self.engine] + ([self.eval.engine_config] if self.eval.engine_config is not None else [])
        return all(e.type == "hf" for e in engines)

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        """Load a config file; errors name the file and the offending field."""
        return cls.model_validate_file_dict(cls.read_toml(path), source=str(path))

    @staticmethod
    def read_toml(path: str | Path) -> dict[str, Any]:
        """A config file's tables as written (not validated: flags go on top before validation)."""
        path = Path(path)
        try:
            return tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None

    @classmethod
    def model_validate_file_dict(cls, raw: dict[str, Any], source: str) -> RunConfig:
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise ValueError(f"{source}: invalid run config:\n{e}") from None

    def public_dict(self) -> dict[str, Any]:
        """The config as JSON-able data, without secrets (storage options are dropped)."""
        data = self.model_dump(mode="json")
        data["storage"].pop("storage_options", None)
        for table, given in zip(dataset_tables(data), dataset_tables(self.model_dump())):
            if given.get("storage_options"):
                table["storage_options"] = REDACTED
        return data
