"""The run config: ``RunConfig``, the one object a run is built from, and its tables.

The same model is the Prefect flow parameter (the UI form), the TOML config file and the target
of the ``miles`` command-line flags (which keep Miles' names, see ``miles_core.cli``). Every name
is imported from here (``from miles_core.config import RunConfig``); the parts live in:

- ``schema``: the tables (model, data, rollout, mode, engine, train, eval, tracking, checkpoint,
  storage, LoRA, resources), with their tagged unions.
- ``run``: ``RunConfig``, the whole run: checks across tables, what the run derives
  (``trainer_config``, ``adapter_configs``), TOML files, and ``updated(overrides)``.
- ``overrides``: the one merger of overrides onto a raw config (``merge_overrides``; dotted keys
  through ``expand_dotted``), used by ``RunConfig.updated``, the flags and deployment parameters.
- ``migrations``: older config shapes read in today's (``mode_table``, ``upgrade_mode``).
- ``secrets``: secret storage options kept out of the config's JSON (``StorageOptions``,
  ``WITH_SECRETS``, ``without_secrets``, ``REDACTED``).
- ``forms``: what the Prefect UI's form needs of the JSON schema (field order, dotted keys).

This package imports without torch, transformers or prefect (a test checks it).
"""

from miles_core.config.migrations import mode_table, upgrade_mode
from miles_core.config.overrides import expand_dotted, merge_overrides
from miles_core.config.run import RunConfig
from miles_core.config.schema import (
    EVAL_INHERITS,
    IMPLICIT_EVAL_DATASET,
    MODE_TABLES,
    AdapterSpec,
    AsyncConfig,
    AsyncMode,
    CheckpointConfig,
    DataConfig,
    DeepSpeedTrainerConfig,
    DrGRPOLossConfig,
    EngineConfig,
    EvalConfig,
    EvalDatasetConfig,
    FileDataConfig,
    FullyAsyncMode,
    GRPOLossConfig,
    GSPOLossConfig,
    HFEngineConfig,
    LoraConfig,
    LossConfig,
    ModeConfig,
    ModelConfig,
    MultiLoraConfig,
    ReinforcePPBaselineLossConfig,
    ReinforcePPLossConfig,
    ResourcesConfig,
    RolloutConfig,
    SGLangEngineConfig,
    StorageConfig,
    SyncMode,
    TinyModelRecipe,
    TorchTrainerConfig,
    ToyDataConfig,
    TrackingConfig,
    TrainConfig,
    TrainerBackendConfig,
    VLLMEngineConfig,
)
from miles_core.config.secrets import (
    REDACTED,
    SECRET_OPTION,
    WITH_SECRETS,
    StorageOptions,
    dataset_tables,
    without_secrets,
)

__all__ = [
    "EVAL_INHERITS",
    "IMPLICIT_EVAL_DATASET",
    "MODE_TABLES",
    "REDACTED",
    "SECRET_OPTION",
    "WITH_SECRETS",
    "AdapterSpec",
    "AsyncConfig",
    "AsyncMode",
    "CheckpointConfig",
    "DataConfig",
    "DeepSpeedTrainerConfig",
    "DrGRPOLossConfig",
    "EngineConfig",
    "EvalConfig",
    "EvalDatasetConfig",
    "FileDataConfig",
    "FullyAsyncMode",
    "GRPOLossConfig",
    "GSPOLossConfig",
    "HFEngineConfig",
    "LoraConfig",
    "LossConfig",
    "ModeConfig",
    "ModelConfig",
    "MultiLoraConfig",
    "ReinforcePPBaselineLossConfig",
    "ReinforcePPLossConfig",
    "ResourcesConfig",
    "RolloutConfig",
    "RunConfig",
    "SGLangEngineConfig",
    "StorageConfig",
    "StorageOptions",
    "SyncMode",
    "TinyModelRecipe",
    "TorchTrainerConfig",
    "ToyDataConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainerBackendConfig",
    "VLLMEngineConfig",
    "dataset_tables",
    "expand_dotted",
    "merge_overrides",
    "mode_table",
    "upgrade_mode",
    "without_secrets",
]
