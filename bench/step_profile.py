"""Where a training step goes: ``bench/train_step.py --profile`` (this module does the work).

One process, one torch thread. ``--model tiny`` (the default): the demo's model (``ModelConfig()``:
the warm-started tiny Llama, built once and cached) and the trainer of the default ``TrainConfig``,
two workloads:

- ``toy``: the demo's shape, 32 prompts x 8 samples, addition prompts, responses of 1-4 tokens;
- ``generation-heavy``: the same batch with responses of 48-64 tokens.

``--model smollm2-135m-instruct``: SmolLM2-135M-Instruct and ``configs/smollm2-arith.toml``'s
trainer (micro-batches of 8 samples), 8 prompts x 8 samples with responses of 4-16 tokens (``arith``,
that config's shape).

Each step goes through the run's path: the producer's segment is written (untimed), then read and
decoded, the advantages computed, the trainer steps (its parts timed by wrapping the functions it
calls: collation, the old-logprob and reference passes, the loss forward, backward, gradient
clipping, the optimizer), the new version is exported and published to a local ``WeightStore``,
and an in-process ``HFEngine`` loads it. "Other" is what the trainer's step spends outside the
timed parts. Below the parts: the physical limit of the plain layout on this CPU, one forward +
backward + AdamW of the same padded batch (one pass of the whole batch, every row prompt +
response) in a bare torch loop; and the same trainer with ``share_prompt_forward = false`` (every
row runs its prompt: what the trainer did before prompts were shared). Both step right after each
of our steps on the same batch (interleaved, so the machine's load falls on all alike). The shared
prompt pass computes each prompt once per micro-batch, so our step can be below that limit.

Median of ``--steps`` steps after two warm-up steps, per part."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

# per model: (prompts a step, micro-batch size, {workload: response lengths})
MODELS = {"tiny": (32, None, {"toy": (1, 4), "generation-heavy": (48, 64)}),
          "smollm2-135m-instruct": (8, 8, {"arith": (4, 16)})}
# the parts of the trainer's step that are timed by wrapping; "other (trainer)" is the rest of it
TIMED_IN_STEP = ["collate + pad", "old-logprob forward", "reference forward", "loss forward", "backward",
                 "clip grad norm", "optimizer (AdamW)"]
TRAINER_PARTS = [*TIMED_IN_STEP, "other (trainer)"]
PARTS = ["read + decode segment", "advantages", *TRAINER_PARTS, "export + publish", "engine weight load"]


class Clock:
    """Seconds per named part, within the current step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._wrapped: list[tuple[object, str, object]] = []

    @contextmanager
    def part(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.step[name] += time.perf_counter() - t0

    def wrap(self, owner, attr: str, name):
        """Time every call of ``owner.attr`` as ``name`` (a string, or a function of the call's args)."""
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.part(name(*args, **kwargs) if callable(name) else name):
                return fn(*args, **kwargs)

        self._wrapped.append((owner, attr, fn))
        setattr(owner, attr, timed)

    def unwrap(self) -> None:
        for owner, attr, fn in reversed(self._wrapped):
            setattr(owner, attr, fn)
        self._wrapped.clear()

    def end_step(self) -> None:
        self.steps.append(dict(self.step))
        self.step.clear()

    def medians(self) -> dict[str, float]:
        names = {k for s in self.steps for k in s}
        return {k: statistics.median(s.get(k, 0.0) for s in self.steps) for k in names}


def toy_groups(tokenizer, prompts: int, per_prompt: int, lengths: tuple[int, int], seed: int):
    from miles_core.types import Group, Sample

    rng = random.Random(seed)
    vocab = len(tokenizer)
    groups = []
    for g in range(prompts):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        prompt = f"{a}+{b}="
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        samples = []
        for j in range(per_prompt):
            response = [rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))]
            samples.append(Sample(prompt, prompt_ids, response, "", reward=float(rng.random() < 0.5),
                                  loss_mask=[1] * len(response), rollout_logprobs=[-rng.random()] * len(response),
                                  group_index=g, sample_index=j))
        groups.append(Group(samples))
    return groups


def profile_workload(model_dir: str, lengths: tuple[int, int], steps: int, cfg, prompts: int
                     ) -> tuple[dict[str, float], float, int, int, float, float]:
    """(median seconds per part, median whole step, tokens per batch, padded width, the bare limit,
    the plain-pass trainer's step)."""
    import torch

    from miles_core.config import HFEngineConfig
    from miles_core.engines.hf import HFEngine
    from miles_core.storage import WeightStore
    from miles_core.storage.stream import SampleStream
    from miles_core.train import setup_trainer
    from miles_core.train import torch_trainer as tt
    from miles_core.train.base import TrainBatch
    from miles_core.types import regroup

    root = tempfile.mkdtemp(prefix="step-profile-")
    store = WeightStore(os.path.join(root, "weights"))
    trainer = setup_trainer(cfg, model_dir, store, "float32")
    engine = HFEngine(model_dir, HFEngineConfig())
    stream = SampleStream(root)
    clock = Clock()
    policy = trainer.model
    clock.wrap(tt, "collate", "collate + pad")
    clock.wrap(trainer, "_forward_logprobs",
               lambda model, *a, **k: "old-logprob forward" if model is policy else "reference forward")
    clock.wrap(trainer, "_micro_loss", "loss forward")
    clock.wrap(trainer.optimizer, "step", "optimizer (AdamW)")
    clock.wrap(torch.autograd, "backward", "backward")
    clock.wrap(torch.nn.utils, "clip_grad_norm_", "clip grad norm")
    bare = BareLoop(model_dir, cfg)
    plain = setup_trainer(cfg.model_copy(update={"share_prompt_forward": False}), model_dir, store, "float32")
    whole, limit, plain_steps = [], [], []
    tokens = width = 0
    try:
        for i in range(steps + 2):
            offset = stream.append(toy_groups(engine.tokenizer, prompts, 8, lengths, seed=i))
            t0 = time.perf_counter()
            with clock.part("read + decode segment"):
                groups = regroup(stream.read_segment(offset).samples())
            with clock.part("advantages"):
                batch = TrainBatch.from_groups(groups, 1.0, loss=cfg.loss)
            with clock.part("trainer step"):
                trainer.step(batch)
            with clock.part("export + publish"):
                uri = trainer.export(trainer.version)
            with clock.part("engine weight load"):
                asyncio.run(engine.update_weights(uri, trainer.version))
            whole.append(time.perf_counter() - t0)
            step = clock.step
            step["other (trainer)"] = step.pop("trainer step") - sum(step.get(k, 0.0) for k in TIMED_IN_STEP)
            if i >= 2:
                clock.end_step()
            else:
                clock.step.clear()
            limit.append(bare.step(batch))
            t0 = time.perf_counter()
            plain.step(batch)
            plain_steps.append(time.perf_counter() - t0)
            clock.step.clear()  # the bare loop's and the plain trainer's parts went through the wrapped functions too
            tokens = sum(s.total_len for s in batch.samples)
            width = max(s.total_len for s in batch.samples)
    finally:
        clock.unwrap()
        asyncio.run(engine.close())
    return (clock.medians(), statistics.median(whole[2:]), tokens, width, statistics.median(limit[2:]),
            statistics.median(plain_steps[2:]))


class BareLoop:
    """The physical limit: one forward + backward + AdamW of a batch, padded once, in a bare torch
    loop, on its own copy of the model. Stepped right after each of our steps, on the same batch,
    so load on the machine falls on both alike."""

    def __init__(self, model_dir: str, cfg) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2))

    def step(self, batch) -> float:
        import torch

        from miles_core.train.batch import collate

        t = collate(batch.samples)
        advantages = torch.tensor(batch.advantages).unsqueeze(-1)
        t0 = time.perf_counter()
        logits = self.model(input_ids=t.input_ids, attention_mask=t.attention_mask, position_ids=t.position_ids,
                            use_cache=False).logits
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, t.labels.unsqueeze(-1)).squeeze(-1)
        loss = -(logprobs * advantages * t.loss_mask).sum() / t.loss_mask.sum()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def main(steps: int, model: str = "tiny") -> str:
    import torch

    from miles_core.config import ModelConfig, TrainConfig
    from miles_core.models import ensure_model

    torch.set_num_threads(1)
    prompts, micro_batch, workloads = MODELS[model]
    cfg = TrainConfig() if micro_batch is None else TrainConfig(micro_batch_size=micro_batch)
    model_dir = str(ensure_model(ModelConfig() if model == "tiny" else ModelConfig(path=model), log=lambda *_: None))
    load = os.getloadavg()
    results = {name: profile_workload(model_dir, lengths, steps, cfg, prompts) for name, lengths in workloads.items()}
    described = "the demo's tiny Llama (`ModelConfig()`)" if model == "tiny" else model
    lines = [
        f"Model: {described}, fp32, one torch thread; `TrainConfig()` defaults, micro-batch "
        f"{cfg.micro_batch_size}. "
        f"Batch: {prompts} prompts x 8 samples. Median of {steps} steps after 2 warm-up steps. "
        f"Load average at the start: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}.",
        "",
        "| part | " + " | ".join(f"{n} (ms) | share" for n in workloads) + " |",
        "|---|" + "---:|---:|" * len(workloads),
    ]
    for part in PARTS:
        cells = []
        for name in workloads:
            parts, whole = results[name][0], results[name][1]
            ms = parts.get(part, 0.0) * 1e3
            cells.append(f"{ms:.1f} | {ms / (whole * 1e3):.0%}")
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    lines.append("| **whole step** | " + " | ".join(f"**{results[n][1] * 1e3:.1f}** | 100%" for n in workloads) + " |")
    trainer = {n: sum(results[n][0].get(p, 0.0) for p in TRAINER_PARTS) for n in workloads}
    lines.append("| trainer step (collate .. optimizer) | " + " | ".join(
        f"{trainer[n] * 1e3:.1f} | " for n in workloads) + " |")
    lines.append("| **limit: bare forward + backward + AdamW** | " + " | ".join(
        f"**{results[n][4] * 1e3:.1f}** | " for n in workloads) + " |")
    lines.append("| trainer step / limit | " + " | ".join(
        f"{trainer[n] / results[n][4]:.2f}x | " for n in workloads) + " |")
    lines.append("| trainer step, plain pass (`share_prompt_forward = false`) | " + " | ".join(
        f"{results[n][5] * 1e3:.1f} | " for n in workloads) + " |")
    lines.append("| plain-pass trainer step / limit | " + " | ".join(
        f"{results[n][5] / results[n][4]:.2f}x | " for n in workloads) + " |")
    lines.append("| tokens per batch (padded width) | " + " | ".join(
        f"{results[n][2]} ({results[n][3]}) | " for n in workloads) + " |")
    return "\n".join(lines)
