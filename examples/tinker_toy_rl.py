"""A tinker-cookbook recipe for this project's addition tasks: the cookbook's own RL loop
(``tinker_cookbook.rl.train.main``, unmodified) trains a model through ``miles tinker-serve`` on the
same prompts and reward as a ``miles train`` config:

- ``task=toy`` (default): the built-in tiny model's task, ``configs/toy.toml`` (``"37+45="`` ->
  ``"82"``, exact match; ``miles_core.data.toy``);
- ``task=arith``: ``configs/smollm2-arith.toml``'s (two-digit additions asked in words,
  ``datasets/arith/train.jsonl``, each prompt in the model's chat template as ``miles train``
  renders it, the math reward), for SmolLM2-135M-Instruct.

Run it with the cookbook's environment (``scripts/setup-tinker-cookbook.sh``), from the repository
root, against a service serving the tiny model (``miles tinker-serve --base-model tiny-addition``)::

    TINKER_API_KEY=$MILES_TINKER_API_KEY TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 PYTHONPATH=. \\
    .cache/tinker-cookbook-env/bin/python examples/tinker_toy_rl.py base_url=http://127.0.0.1:8765 \\
        model_name=$(.venv/bin/miles build-model) log_path=/tmp/toy-rl max_steps=20

``model_name`` is the model's folder: the cookbook loads the tokenizer from it. The defaults are
the demo's (``configs/toy.toml``): 32 prompts x 8 samples a step, up to 6 new tokens, temperature 1.
Each step's metrics (``env/all/reward/total``, ...) land in ``<log_path>/metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace

import chz
import tinker
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.tokenizer_utils import get_tokenizer

from miles_core.data.toy import toy_problems, toy_reward


class ToyEnv(Env):
    """One problem: the prompt's tokens in, the answer's tokens out, reward 1 for the right sum
    (exact for the toy task, the math reward for arith)."""

    def __init__(self, prompt: str, label: str, tokenizer, task: str = "toy") -> None:
        self.prompt, self.label, self.tokenizer, self.task = prompt, label, tokenizer, task

    async def initial_observation(self):
        if self.task == "toy":
            tokens = self.tokenizer.encode(self.prompt)
        else:  # as miles_core.data renders a prompt with data.apply_chat_template
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": self.prompt}], tokenize=False,
                                                      add_generation_prompt=True)
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
        return tinker.ModelInput.from_ints(tokens), [self.tokenizer.eos_token_id]

    async def step(self, action, *, extra=None) -> StepResult:
        text = self.tokenizer.decode([t for t in action if t != self.tokenizer.eos_token_id])
        if self.task == "toy":
            reward = toy_reward(text, self.label)
        else:
            from miles_core.rewards.math import math_reward

            reward = math_reward(text, self.label)
        return StepResult(reward=reward, episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=[], metrics={"correct": reward})


class ToyGroup(EnvGroupBuilder):
    def __init__(self, row: dict, model_name: str, group_size: int, task: str = "toy") -> None:
        self.row, self.model_name, self.group_size, self.task = row, model_name, group_size, task

    async def make_envs(self) -> Sequence[Env]:
        tokenizer = get_tokenizer(self.model_name)
        return [ToyEnv(self.row["prompt"], self.row["label"], tokenizer, self.task) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return [self.task]


class ToyDataset(RLDataset):
    def __init__(self, rows: list[dict], batch_size: int, model_name: str, group_size: int, task: str = "toy") -> None:
        self.rows, self.batch_size, self.model_name, self.group_size = rows, batch_size, model_name, group_size
        self.task = task

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        start = index * self.batch_size % len(self.rows)
        rows = (self.rows + self.rows)[start : start + self.batch_size]
        return [ToyGroup(row, self.model_name, self.group_size, self.task) for row in rows]

    def __len__(self) -> int:
        return 10**6


@chz.chz
class ToyDatasetBuilder(RLDatasetBuilder):
    model_name: str
    batch_size: int = 32
    group_size: int = 8
    seed: int = 0
    num_prompts: int = 2048
    task: str = "toy"

    async def __call__(self) -> tuple[ToyDataset, None]:
        if self.task == "arith":
            import json
            from pathlib import Path

            path = Path(__file__).resolve().parents[1] / "datasets" / "arith" / "train.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        else:
            cfg = SimpleNamespace(seed=self.seed, num_prompts=self.num_prompts, max_operand=99)  # ToyDataConfig's
            rows = toy_problems(cfg, "train")
        return ToyDataset(rows, self.batch_size, self.model_name, self.group_size, self.task), None


@chz.chz
class CLIConfig:
    base_url: str
    model_name: str
    log_path: str
    max_steps: int = 20
    batch_size: int = 32
    group_size: int = 8
    learning_rate: float = 1e-4
    lora_rank: int = 8
    max_tokens: int = 6
    temperature: float = 1.0
    loss_fn: str = "importance_sampling"
    seed: int = 0
    task: str = "toy"


async def run(cli: CLIConfig) -> None:
    config = train.Config(
        learning_rate=cli.learning_rate, model_name=cli.model_name, recipe_name="miles-toy-addition",
        dataset_builder=ToyDatasetBuilder(model_name=cli.model_name, batch_size=cli.batch_size,
                                          group_size=cli.group_size, seed=cli.seed, task=cli.task),
        max_tokens=cli.max_tokens, temperature=cli.temperature, log_path=cli.log_path, lora_rank=cli.lora_rank,
        loss_fn=cli.loss_fn, base_url=cli.base_url, max_steps=cli.max_steps, eval_every=0, save_every=0,
        renderer_name="role_colon",  # unused by this task (it renders no chat); set so no registry lookup happens
    )
    await train.main(config)


if __name__ == "__main__":
    asyncio.run(run(chz.entrypoint(CLIConfig)))
