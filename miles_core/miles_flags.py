"""Every Miles flag, and what it does here: the ``miles`` command's compatibility table.

- ``miles_flags()``: Miles' flags (``miles_flags.txt``: Miles' own argument files, the Megatron
  flags it re-defaults, its FSDP backend's), then the ones Miles' execution-mode documents use that
  Miles itself does not define (``--lora-count``, ``--model``, ``--sglang-enable-ep-moe``).
- ``unsupported(flag)``: None when ``miles`` takes the flag (``FLAGS``, ``SWITCHES`` or a
  flag ``cli`` handles itself), else what to use instead. ``cli.build_parser`` registers every
  unsupported flag so that using it stops with that hint: no Miles flag is ignored, and none is
  taken for an abbreviation of another.
- ``NOTES``: how a supported flag differs from Miles' meaning.
- ``flags_markdown()``: ``docs/miles-flags.md`` (a unit test keeps it current).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

# flag -> dotted path in RunConfig. Names follow Miles where Miles has the flag.
FLAGS: dict[str, str] = {
    "--name": "name",
    "--run-id": "run_id",
    "--seed": "seed",
    "--rollout-seed": "seed",  # Miles: the prompt order's and sampling's seed, which ``seed`` is here
    "--hf-checkpoint": "model.path",
    "--prompt-data": "data.path",
    "--input-key": "data.input_key",
    "--label-key": "data.label_key",
    "--apply-chat-template": "data.apply_chat_template",
    "--num-rollout": "rollout.num_rollout",
    "--rollout-batch-size": "rollout.rollout_batch_size",
    "--n-samples-per-prompt": "rollout.n_samples_per_prompt",
    "--rollout-max-response-len": "rollout.rollout_max_response_len",
    "--rollout-temperature": "rollout.rollout_temperature",
    "--rollout-top-p": "rollout.rollout_top_p",
    "--rollout-top-k": "rollout.rollout_top_k",
    "--rollout-stop": "rollout.rollout_stop",
    "--rollout-stop-token-ids": "rollout.rollout_stop_token_ids",
    "--rollout-shuffle": "rollout.rollout_shuffle",
    "--rm-type": "rollout.reward",
    "--custom-rm-path": "rollout.reward",
    "--reward-timeout": "rollout.reward_timeout_s",
    "--rm-url": "rollout.rm_url",
    "--custom-reward-post-process-path": "rollout.reward_post_process_path",
    "--custom-generate-function-path": "rollout.custom_generate_function_path",
    "--rollout-function-path": "rollout.rollout_function_path",
    "--custom-async-data-buffer-path": "mode.custom_data_buffer_path",
    "--global-batch-size": "train.global_batch_size",
    "--num-steps-per-rollout": "train.num_steps_per_rollout",
    "--micro-batch-size": "train.micro_batch_size",
    "--share-prompt-forward": "train.share_prompt_forward",
    "--lr": "train.lr",
    "--weight-decay": "train.weight_decay",
    "--adam-beta1": "train.adam_beta1",
    "--adam-beta2": "train.adam_beta2",
    "--clip-grad": "train.clip_grad",
    "--max-skipped-steps": "train.max_skipped_steps",
    "--advantage-estimator": "train.loss.type",
    "--eps-clip": "train.loss.eps_clip",
    "--eps-clip-high": "train.loss.eps_clip_high",
    "--eps-clip-c": "train.loss.eps_clip_c",
    "--entropy-coef": "train.entropy_coef",
    "--kl-coef": "train.kl_coef",
    "--kl-loss-coef": "train.kl_loss_coef",
    "--kl-loss-type": "train.kl_type",
    "--use-tis": "train.use_tis",
    "--tis-mode": "train.tis_mode",
    "--tis-clip": "train.tis_clip",
    "--tis-clip-low": "train.tis_clip_low",
    "--train-backend": "train.backend.type",
    "--zero-stage": "train.backend.zero_stage",
    "--deepspeed-precision": "train.backend.precision",
    "--trainer-processes": "train.backend.num_processes",
    "--trainer-launcher": "train.backend.launcher",
    "--lora-rank": "lora.rank",
    "--lora-alpha": "lora.alpha",
    "--lora-dropout": "lora.dropout",
    "--target-modules": "lora.target_modules",
    "--eval-interval": "eval.eval_interval",
    "--eval-prompt-data": "eval.data.path",
    "--n-samples-per-eval-prompt": "eval.n_samples_per_prompt",
    "--eval-temperature": "eval.temperature",
    "--eval-top-p": "eval.top_p",
    "--eval-max-response-len": "eval.max_response_len",
    "--eval-num-prompts": "eval.num_prompts",
    "--skip-eval-before-train": "eval.skip_eval_before_train",
    "--save-interval": "checkpoint.save_interval",
    "--max-tokens-per-gpu": "train.max_tokens_per_gpu",
    "--keep-checkpoints": "checkpoint.keep_checkpoints",
    "--mode": "mode.type",
    "--update-weights-interval": "mode.update_weights_interval",
    "--async-max-concurrent-samples": "mode.max_concurrent_samples",
    "--async-submit-granularity": "mode.submit_granularity",
    "--async-data-buffer-capacity-factor": "mode.buffer_capacity_factor",
    "--max-weight-staleness": "mode.max_weight_staleness",
    "--rollout-producers": "mode.rollout_producers",
    "--rollout-deployment": "mode.rollout_deployment",
    "--producer-heartbeat-timeout": "mode.producer_heartbeat_timeout_s",
    "--producer-restarts": "mode.producer_restarts",
    "--async-unused-samples-handler": "mode.unused_samples_handler",
    "--dynamic-sampling-filters": "mode.dynamic_filters",
    "--partial-rollout": "mode.partial_rollout",
    "--no-progress-seconds": "mode.no_progress_s",
    "--generation-retries": "mode.generation_retries",
    "--eval-engine": "eval.engine",
    "--eval-max-in-flight": "eval.max_in_flight",
    "--eval-overflow": "eval.overflow",
    "--multi-lora-n-adapters": "multi_lora.n_adapters",
    "--lora-count": "multi_lora.n_adapters",
    "--multi-lora-rollout-source": "multi_lora.rollout_source",
    "--multi-lora-lead-adapter": "multi_lora.lead_adapter",
    "--multi-lora-shared-base": "multi_lora.shared_base",
    "--device-pool": "resources.pool",
    "--rollout-slots": "resources.rollout_slots",
    "--train-slots": "resources.train_slots",
    "--eval-slots": "resources.eval_slots",
    "--storage-root": "storage.root",
    "--save": "storage.root",  # Miles' checkpoint folder: here the run folder, checkpoints and all, goes under it
    "--storage-credentials-block": "storage.credentials_block",
    "--segment-compression": "storage.segment_compression",
    "--lr-decay-style": "train.lr_decay_style",
    "--lr-warmup-iters": "train.lr_warmup_steps",
    "--lr-decay-iters": "train.lr_decay_steps",
    "--min-lr": "train.min_lr",
    "--use-wandb": "tracking.wandb",
    "--wandb-project": "tracking.wandb_project",
    "--wandb-team": "tracking.wandb_entity",
    "--wandb-group": "tracking.wandb_group",
    "--wandb-mode": "tracking.wandb_mode",
    "--wandb-dir": "tracking.wandb_dir",
    "--wandb-run-name": "tracking.wandb_run_name",
    "--use-tensorboard": "tracking.tensorboard",
    "--tensorboard-dir": "tracking.tensorboard_dir",
    "--tb-project-name": "tracking.tensorboard_dir",  # Miles: TensorBoard's log folder
    "--use-mlflow": "tracking.mlflow",
    "--mlflow-tracking-uri": "tracking.mlflow_tracking_uri",
    "--mlflow-experiment-name": "tracking.mlflow_experiment",
    "--mlflow-run-name": "tracking.mlflow_run_name",
    "--ui-update-every-s": "tracking.live_every_s",
}
# Flags whose value maps to a fixed setting (Miles spellings of our options).
SWITCHES: dict[str, tuple[str, Any]] = {
    "--fully-async": ("mode.type", "fully_async"),
    "--use-rollout-logprobs": ("train.old_logprobs", "rollout"),
    "--disable-grpo-std-normalization": ("train.loss.advantage_std_normalize", False),
    "--use-dynamic-batch-size": ("train.use_dynamic_batch_size", True),
    "--gradient-checkpointing": ("train.gradient_checkpointing", True),
}
KL_ALIASES = {"kl": "k1", "low_var_kl": "k3"}

MODE_FLAGS = ("--fully-async", "--num-rollout", "--model", "--rollout-batch-size", "--num-steps-per-rollout",
              "--eval-interval", "--async-max-concurrent-samples", "--async-unused-samples-handler", "--lora-count",
              "--rollout-function-path", "--partial-rollout", "--sglang-server-concurrency",
              "--use-rollout-routing-replay", "--sglang-enable-ep-moe")
"""The flags Miles' documents of its execution modes (async, fully async, multi-LoRA) use."""
DOC_FLAGS = ("--lora-count", "--model", "--sglang-enable-ep-moe")
"""Of those, the ones Miles' argument files do not define."""

SPECIAL = ("--config", "--load", "--use-kl-loss", "--eval-input-key", "--eval-label-key", "--num-epoch")
"""Miles flags ``cli`` parses itself (not through ``FLAGS`` or ``SWITCHES``)."""

NOTES = {
    "--load": "a run folder (`<root>/<name>/<run id>`) to resume from its latest checkpoint; Miles: a "
              "Megatron checkpoint root",
    "--save": "the storage root (`storage.root`): the run folder, with its checkpoints, samples and "
              "weights, goes under it; checkpoints every `--save-interval` steps",
    "--use-kl-loss": "needs `--kl-loss-coef` > 0 (the KL term is in the loss exactly when its coefficient "
                     "is); Miles only logs the KL when the coefficient is 0",
    "--lora-count": "same as `--multi-lora-n-adapters` (Miles' docs spell it `--lora-count`); "
                    "`miles train` then runs the multi-LoRA flow",
    "--lr-decay-style": "`constant` (the default here; Megatron's is `linear`), `linear` or `cosine`, over "
                        "`--lr-decay-iters` optimizer steps (default: the run's)",
    "--lr-warmup-iters": "linear warmup from 0 over this many optimizer steps",
    "--lr-decay-iters": "optimizer steps, warmup included (default: `--num-rollout` x steps per rollout)",
    "--num-epoch": "sets `--num-rollout` to epochs x the dataset's prompts // `--rollout-batch-size`, as Miles "
                   "does (the dataset is read once to count them); not with `--num-rollout`",
    "--rollout-seed": "the run's seed of prompt order and sampling (`seed`, also `--seed`)",
    "--seed": "the run's seed of prompt order and sampling; the trainer's is `train.seed`",
    "--train-backend": "`torch` or `deepspeed` (Miles: `megatron` or `fsdp`)",
    "--eval-prompt-data": "`NAME PATH` pairs, as in Miles; one `PATH` alone is the single held-out set",
    "--config": "a TOML run config (Miles: YAML of its own)",
    "--eval-input-key": "the prompt key of every held-out file (default: the training data's `--input-key`)",
    "--eval-label-key": "the label key of every held-out file (default: the training data's `--label-key`)",
    "--rm-type": "a built-in reward by name",
    "--micro-batch-size": "samples per forward/backward pass (Miles: per GPU)",
    "--kl-loss-type": "`k1`, `k2`, `k3` (`low_var_kl` is `k3`, `kl` is `k1`)",
    "--use-wandb": "needs `wandb` (`pip install 'miles-prefect[trackers]'`); metric names as in `metrics.jsonl`, "
                   "evaluations as `eval/<name>`",
    "--wandb-team": "the W&B entity",
    "--use-tensorboard": "needs `tensorboard`; event files in the run folder's `tensorboard/` by default",
    "--tb-project-name": "TensorBoard's log folder (as `--tensorboard-dir`)",
    "--use-mlflow": "needs `mlflow-skinny`; default store `sqlite:///mlflow.db`, as MLflow's own (its file store is "
                    "retired); `pass@k` is `pass_at_k` there",
}

_GROUPS: list[tuple[tuple[str, ...], str]] = [
    (("--sglang-", "--eval-sglang-", "--router-", "--use-miles-router", "--miles-router-", "--no-sglang-"),
     "an SGLang server setting: start SGLang with it and point the run at the server (`engine.type = "
     "\"sglang\"`, `engine.url`)"),
    (("--actor-num-", "--critic-", "--rollout-num-gpus", "--num-gpus-per-node", "--colocate", "--offload",
      "--pin-rollout-manager-to-head", "--eval-num-gpus", "--prefill-num-servers", "--num-critic-only-steps",
      "--rollout-external"),
     "placement is Prefect's here: producers and the trainer run as flow runs on their work pools "
     "(`--rollout-deployment`, `--rollout-producers`, `--trainer-processes`, `--device-pool`)"),
    (("--use-prometheus", "--prometheus-", "--use-miles-dashboard", "--dashboard-", "--log-"),
     "not here: every step's metrics are in the run folder's `metrics.jsonl`, the run's Prefect artifacts "
     "(progress, metrics table, curves) and W&B, TensorBoard or MLflow (`--use-wandb`, `--use-tensorboard`, "
     "`--use-mlflow`)"),
    (("--lr-", "--use-checkpoint-lr-scheduler", "--override-lr-scheduler", "--warmup-ratio"),
     "the schedule here is `--lr-decay-style constant|linear|cosine` with `--lr-warmup-iters`, `--lr-decay-iters` "
     "and `--min-lr` (a resumed run takes it from its config)"),
    (("--update-weight-", "--p2p-transfer-", "--custom-update-weight-"),
     "weights travel as versioned safetensors snapshots through the run's storage (`storage.root`)"),
    (("--use-fault-tolerance", "--ft-components", "--rollout-health-check-", "--trainer-heartbeat-checker-",
      "--mini-ft-controller-", "--control-server-port"),
     "here producers heartbeat and are replaced (`--producer-heartbeat-timeout`, `--producer-restarts`), "
     "and runs resume from checkpoints (`--save-interval`, `--run-id`)"),
    (("--multi-lora-",),
     "multi-LoRA here: `--lora-count N` (or `--multi-lora-n-adapters`) or a `[multi_lora]` table of adapters"),
    (("--debug-", "--ci-", "--dumper-", "--memory-", "--profile-", "--check-", "--save-debug-", "--load-debug-",
      "--dump-details", "--enable-event-analyzer", "--enable-witness", "--witness-", "--env-report",
      "--record-memory-history", "--use-pytorch-profiler", "--save-local-weight-checksum"),
     "one of Miles' debugging and CI hooks: no equivalent here"),
    (("--megatron-", "--custom-megatron-", "--qkv-format", "--dsa-", "--miles-dsa-", "--mtp-", "--enable-mtp-",
      "--fsdp-", "--extra-high-precision-", "--rematerialize-", "--check-rematerialize-", "--custom-model-provider-",
      "--distributed-", "--padded-vocab-size", "--calculate-per-token-loss", "--attn-implementation",
      "--keep-fp32-master", "--dp-replicate-size", "--context-parallel-size",
      "--allgather-cp", "--indep-dp", "--linear-attention-backend", "--fp16", "--optimizer", "--adam-eps",
      "--low-memory-resume", "--async-save", "--no-save-optim", "--stream-optimizer-state-", "--train-memory-",
      "--train-env-vars", "--freeze-indexer", "--deterministic-mode"),
     "a Megatron or FSDP setting: the trainer here is torch or DeepSpeed ZeRO (`--train-backend deepspeed`, "
     "`--zero-stage`, `--deepspeed-precision`)"),
]

HINTS = {
    "--model": "not a Miles flag (its documents' shorthand for the model): use `--hf-checkpoint PATH`",
    "--model-name": "not needed: the model folder's `config.json` names its type (`--hf-checkpoint PATH`)",
    "--ref-load": "the reference policy is the starting model (`--hf-checkpoint`); with LoRA, the base",
    "--save-hf": "every version is a safetensors snapshot (a PEFT folder with LoRA) under the run folder's "
                 "`weights/`",
    "--over-sampling-batch-size": "fully-async mode (`--fully-async`) keeps generating until a batch of the "
                                  "groups `--dynamic-sampling-filters` accept is full",
    "--dynamic-sampling-filter-path": "`--dynamic-sampling-filters module:function` (or a built-in name: "
                                      "`nonzero_reward_std`, `not_all_failed`)",
    "--sglang-server-concurrency": "`--async-max-concurrent-samples` (samples in flight) or `engine.max_batch_size`",
    "--use-rollout-routing-replay": "MoE routing replay: not supported",
    "--use-routing-replay": "MoE routing replay: not supported",
    "--custom-config-path": "`--config FILE.toml` (a TOML run config)",
    "--eval-top-k": "evaluation samples with `--eval-temperature` and `--eval-top-p`",
    "--wandb-key": "set `WANDB_API_KEY` in the environment (a key never goes in the config, which is kept in "
                   "the run folder and in Prefect's database)",
    "--wandb-host": "set `WANDB_BASE_URL` in the environment",
    "--wandb-run-id": "the W&B run id is the run id (`--run-id`): a resumed run goes on in its W&B run",
    "--disable-wandb-random-suffix": "the W&B run is named `<name>-<run id>` (`--wandb-run-name` to name it)",
    "--wandb-always-use-train-step": "always so: every metric is logged against the training step",
    "--mlflow-run-id": "the MLflow run is found by its `miles.run_id` tag: `--run-id` (a resumed run goes on "
                       "in it)",
    "--tb-experiment-name": "`--tensorboard-dir DIR` (default: the run folder's `tensorboard/`)",
}


@cache
def miles_flags() -> tuple[str, ...]:
    """Miles' flags (``miles_flags.txt``), then ``DOC_FLAGS``."""
    lines = (Path(__file__).with_name("miles_flags.txt")).read_text().splitlines()
    return tuple(dict.fromkeys([ln.strip() for ln in lines if ln.startswith("--")] + list(DOC_FLAGS)))


@cache
def supported() -> frozenset[str]:
    return frozenset(FLAGS) | frozenset(SWITCHES) | frozenset(SPECIAL)


def unsupported(flag: str) -> str | None:
    """None if ``miles`` takes ``flag``; else what to use instead."""
    if flag in supported():
        return None
    return hint_for(flag) or "no equivalent here"


def hint_for(flag: str) -> str | None:
    """What to use instead of ``flag``, if it is one of the Miles flags ``HINTS`` or ``_GROUPS`` know
    (a group covers flags by prefix, such as every ``--sglang-<SGLang flag>``); None otherwise."""
    if flag in HINTS:
        return HINTS[flag]
    return next((hint for prefixes, hint in _GROUPS if flag.startswith(prefixes)), None)


def flags_markdown() -> str:
    """``docs/miles-flags.md``: every flag of ``miles_flags()``, whether ``miles`` takes it, and what to
    use where it does not."""
    def row(flag: str) -> str:
        hint = unsupported(flag)
        if hint is not None:
            return f"| `{flag}` | no | {hint} |"
        target = FLAGS.get(flag) or (f"{SWITCHES[flag][0]} = {SWITCHES[flag][1]!r}" if flag in SWITCHES else "")
        return f"| `{flag}` | {f'yes (`{target}`)' if target else 'yes'} | {NOTES.get(flag, '')} |"

    head = ["| Miles flag | here | note / what to use instead |", "|---|---|---|"]
    taken = sum(1 for f in miles_flags() if unsupported(f) is None)
    return "\n".join([
        "# Miles flags",
        "",
        "<!-- generated by `miles flags-doc`; a unit test keeps it current -->",
        "",
        f"Every flag of Miles' argument parsers ({len(miles_flags()) - len(DOC_FLAGS)}: Miles' own, the Megatron",
        "flags it re-defaults, its FSDP backend's) and the ones its execution-mode documents use, and",
        f"what `miles train` does with each. {taken} are taken; every other one stops the command with",
        "the hint in its row, so no Miles flag is silently ignored (and none is read as an abbreviation of",
        "another). Flags of ours that Miles does not have are in [config.md](config.md).",
        "",
        "## The flags of Miles' execution modes",
        "",
        "The ones Miles' documents of its async, fully-async and multi-LoRA modes use.",
        "",
        *head,
        *(row(f) for f in MODE_FLAGS),
        "",
        "## Every Miles flag",
        "",
        "In the order of Miles' argument files. SGLang's own flags reach Miles as `--sglang-<flag>` and",
        "`--eval-sglang-<flag>`; `miles` refuses any of them, saying to start SGLang with the setting and",
        "point the run at the server (`engine.url`).",
        "",
        *head,
        *(row(f) for f in miles_flags()),
        "",
    ])
