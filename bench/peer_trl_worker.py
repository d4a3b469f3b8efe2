"""One Hugging Face TRL ``GRPOTrainer`` run for ``bench/peer_trl.py``, in TRL's own virtual environment.

Run by the driver, not by hand: ``<trl venv>/bin/python bench/peer_trl_worker.py SPEC.json``.
This file imports only TRL, transformers, datasets and torch (nothing of this project), so TRL
runs exactly as a TRL user would run it (``answer_matches``, the arithmetic task's reward, lives here
so that ours can use the very same function). SPEC names the task (``toy``: exact match; ``arith``:
conversational prompts, ``answer_matches``), the starting model folder, the training rows
(``{"prompt", "label"}``), the hyperparameters and an output folder; the worker trains
``steps`` optimizer steps, saves the policy's state dict after every ``snapshot_every``-th step
(``snapshots/step-000005.safetensors``; the time spent saving is subtracted from the training
clock) and writes ``result.json``: the training seconds after each step, the process's CPU
seconds and peak RSS, and TRL's version.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
from pathlib import Path

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer_matches(text: str, label: str) -> float:
    """The arithmetic task's reward, for TRL and ours alike: 1.0 when the last number in ``text``
    is ``label`` ("122", "122.", "The answer is 122"), else 0.0."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return 1.0 if numbers and float(numbers[-1]) == float(label) else 0.0


def answer_reward(sample) -> float:
    """``answer_matches`` as our per-sample reward (``rollout.reward = "bench.peer_trl_worker:answer_reward"``)."""
    return answer_matches(sample.response, sample.label)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    import transformers
    import trl
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    out = Path(spec["out"])
    (out / "snapshots").mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows = spec["rows"]
    chat = spec.get("task") == "arith"  # conversational prompts: TRL applies the model's chat template
    prompts = [[{"role": "user", "content": r["prompt"]}] if chat else r["prompt"] for r in rows]
    train = datasets.Dataset.from_dict({"prompt": prompts, "label": [r["label"] for r in rows]})

    def exact_match(completions: list, label: list[str], **_: object) -> list[float]:
        if chat:  # each completion is its messages; the task's reward reads the answer's last number
            return [answer_matches(c[0]["content"], a) for c, a in zip(completions, label)]
        # the toy task's reward: the response, stripped, is exactly the label
        return [1.0 if c.strip() == str(a).strip() else 0.0 for c, a in zip(completions, label)]

    class Clock(TrainerCallback):
        """Training seconds after each step, with the snapshot saves taken out."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.saving = 0.0
            self.seconds: list[float] = []

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.seconds.append(now - self.t0 - self.saving)
            if state.global_step % spec["snapshot_every"] == 0 or state.global_step == spec["steps"]:
                tensors = {k: v.detach().clone().contiguous() for k, v in kw["model"].state_dict().items()}
                save_file(tensors, str(out / "snapshots" / f"step-{state.global_step:06d}.safetensors"))
            self.saving += time.perf_counter() - now

    config = trl.GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=spec["adam_beta1"],
        adam_beta2=spec["adam_beta2"],
        weight_decay=0.0,
        max_grad_norm=spec["clip_grad"],
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["prompts"] * spec["samples"] // spec["micro_batch"],
        num_generations=spec["samples"],
        max_completion_length=spec["max_len"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=spec["eps_clip"],
        loss_type="dapo",  # token-level mean over the batch: our "grpo" with reducer "token_mean"
        scale_rewards="group",
        num_iterations=1,
        seed=spec["seed"],
        data_seed=spec["seed"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        gradient_checkpointing=False,  # on by default in TRL; ours runs without it too
        dataloader_num_workers=0,
    )
    clock = Clock()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=train,
                              processing_class=tokenizer, callbacks=[clock])
    cpu0 = time.process_time()
    trainer.train()
    result = {
        "seconds": clock.seconds,
        "cpu_seconds": time.process_time() - cpu0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "log": [h for h in trainer.state.log_history if "reward" in h],
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
