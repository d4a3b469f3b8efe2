"""A tinker-cookbook supervised recipe for this project's toy addition task: the cookbook's own
supervised loop (``tinker_cookbook.supervised.train.main``, unmodified) fine-tunes the built-in tiny
model through ``miles tinker-serve`` on right answers (``"37+45="`` -> ``"82"`` and the end of
sequence; ``miles_core.data.toy``), the loss on the answer's tokens only.

Run it with the cookbook's environment (``scripts/setup-tinker-cookbook.sh``), from the repository
root, against a service serving the tiny model (``miles tinker-serve --base-model tiny-addition``)::

    TINKER_API_KEY=$MILES_TINKER_API_KEY TINKER_TELEMETRY=0 HF_HUB_OFFLINE=1 PYTHONPATH=. \\
    .cache/tinker-cookbook-env/bin/python examples/tinker_toy_sft.py base_url=http://127.0.0.1:8765 \\
        model_name=$(.venv/bin/miles build-model) log_path=/tmp/toy-sft max_steps=20

Each step's metrics (``train_mean_nll``, ...) land in ``<log_path>/metrics.jsonl``; the final
checkpoint's ``tinker://`` paths (state and sampler weights) in ``<log_path>/checkpoints.jsonl``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import chz
import tinker
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from miles_core.data.toy import toy_problems


def answer_datum(tokenizer, prompt: str, answer: str) -> tinker.Datum:
    """``prompt`` then ``answer`` and EOS, next-token targets, weight 1 on the answer's tokens only."""
    p = tokenizer.encode(prompt)
    a = tokenizer.encode(answer) + [tokenizer.eos_token_id]
    tokens = p + a
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(a)})


class ToyAnswers(SupervisedDataset):
    def __init__(self, rows: list[dict], batch_size: int, tokenizer) -> None:
        self.rows, self.batch_size, self.tokenizer = rows, batch_size, tokenizer

    def get_batch(self, index: int) -> list[tinker.Datum]:
        rows = self.rows[index * self.batch_size:(index + 1) * self.batch_size]
        return [answer_datum(self.tokenizer, r["prompt"], r["label"]) for r in rows]

    def __len__(self) -> int:
        return len(self.rows) // self.batch_size


@chz.chz
class ToyAnswersBuilder(SupervisedDatasetBuilder):
    model_name: str
    batch_size: int = 32
    seed: int = 0
    num_prompts: int = 2048

    def __call__(self) -> tuple[ToyAnswers, None]:
        cfg = SimpleNamespace(seed=self.seed, num_prompts=self.num_prompts, max_operand=99)  # ToyDataConfig's fields
        return ToyAnswers(toy_problems(cfg, "sft"), self.batch_size, get_tokenizer(self.model_name)), None


@chz.chz
class CLIConfig:
    base_url: str
    model_name: str
    log_path: str
    max_steps: int = 20
    batch_size: int = 32
    learning_rate: float = 1e-3
    lora_rank: int = 8
    seed: int = 0


async def run(cli: CLIConfig) -> None:
    config = train.Config(
        log_path=cli.log_path, model_name=cli.model_name, recipe_name="miles-toy-sft",
        dataset_builder=ToyAnswersBuilder(model_name=cli.model_name, batch_size=cli.batch_size, seed=cli.seed),
        learning_rate=cli.learning_rate, lr_schedule="constant", lora_rank=cli.lora_rank, base_url=cli.base_url,
        max_steps=cli.max_steps, save_every=0, eval_every=0, renderer_name="role_colon",
    )
    await train.main(config)


if __name__ == "__main__":
    asyncio.run(run(chz.entrypoint(CLIConfig)))
