"""The built-in tiny model: a character-level tokenizer and a small Llama-config causal LM that a
short supervised phase warm-starts on the toy addition task, cached by the hash of its recipe.

- ``build_tokenizer()``: printable-ASCII character tokenizer (``tokenizers`` WordLevel + Fuse
  decoder) wrapped as ``PreTrainedTokenizerFast``; ``<pad>`` is id 0, ``<eos>`` id 1.
- ``build_untrained(recipe, out_dir)``: a randomly initialised model saved with its tokenizer.
- ``warm_start(model_dir, recipe, log)``: the supervised phase on the toy task's ``sft`` split
  (teacher forcing on ``prompt + answer + <eos>``, loss on the answer tokens only, AdamW with
  warmup and cosine decay, seeded), saved back into ``model_dir``. Helpers: ``sft_rows`` (the
  corpus), ``pick_carry_free`` (which label each drawn carry problem gets).
- ``greedy_accuracy(model, tokenizer, rows)``: batched greedy exact-match accuracy, for the build
  report only (runs evaluate through the rollout engine).
- ``ensure_tiny(recipe, cache_dir, log, shipped)``: the folder of the built-in tiny model,
  ``<cache_dir>/tiny-addition-<recipe hash>``, built once (untrained, warm start, held-out
  evaluation, ``warm_start.json``) in a temporary folder that is renamed into place with the
  ``_COMPLETE`` marker already inside; readers trust only the marker. A file lock makes concurrent
  callers wait for one build instead of repeating it. The default recipe's build ships with the
  package (``shipped/``, 1.4 MB, built on this project's 2-core CPU machine, ~2 min): a fresh clone
  copies it into the cache instead of building (``shipped=False``, ``miles build-model
  --no-shipped``, builds from the recipe). A recipe, or recipe code, of its own has another hash and
  is built.

The warm start deliberately teaches a systematic mistake. An honest short phase (under-trained
on true sums) left held-out greedy accuracy in range, but its errors were scattered over the
ones digit, and 60 GRPO steps did not raise greedy accuracy (0.38 before, 0.31-0.34 after, at
learning rates 3e-5 to 1e-4; higher rates lowered it more). So the warm start has two phases:
``recipe.sft_steps`` on true sums (the model learns addition, ~0.9-1.0 held-out), then
``recipe.sft_mistake_steps`` in which each carry problem drawn is labelled, with probability
``recipe.sft_carry_free_share``, with its carry-free sum (``37+45=72``: every carry forgotten).
The starting policy then forgets carries on most carry problems when greedy (held-out greedy
accuracy 0.32-0.42 over seeds 0-4, about the 0.30 share of carry-free problems) but carries in
part of its samples (pass@8 at temperature 1 ~0.7), and RL learns to carry again (0.84-0.96
greedy after 60 GRPO steps of 32 prompts x 8 samples at lr 3e-4).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import string
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

    from miles_core.config import TinyModelRecipe

PAD, EOS = "<pad>", "<eos>"
BUILTIN_TINY = "builtin:tiny-addition"
COMPLETE_MARKER = "_COMPLETE"
SHIPPED = Path(__file__).with_name("shipped")
"""Builds that ship with the package, one folder per recipe hash (as in the cache, no marker)."""
RECIPE_CODE_VERSION = 1
"""Bump when the build code (tokenizer, architecture, warm start, corpus) changes: it is part of
the cache key, so old cached models are not reused."""
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, padding_side="left", clean_up_tokenization_spaces=False
    )


def build_untrained(recipe: TinyModelRecipe, out_dir: str | Path) -> Path:
    """Save a randomly initialised tiny Llama model and its tokenizer to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------ warm start


def _sft_tensors(tokenizer: PreTrainedTokenizerFast, rows: Sequence[dict[str, str]]) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded ``prompt + label + <eos>`` ids, attention mask and labels (-100 on prompt and pad)."""
    import torch

    seqs, masks = [], []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["label"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (seq, mask) in enumerate(zip(seqs, masks)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        labels[i, : len(seq)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(seq), -100)
    return ids, attention, labels


def _cosine_schedule(steps: int) -> Callable[[int], float]:
    warmup = max(1, min(50, steps // 10))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def sft_rows(recipe: TinyModelRecipe) -> list[dict[str, str]]:
    """The warm-start problems: ``recipe.sft_examples`` of the toy task's ``sft`` split, with the
    true answer as ``label`` and the carry-free sum as ``carry_free_label``."""
    from miles_core.config import ToyDataConfig
    from miles_core.data.toy import carry_free_sum, toy_problems

    toy_cfg = ToyDataConfig(max_operand=recipe.max_operand, seed=recipe.seed)
    rows = []
    for row in toy_problems(toy_cfg, "sft", recipe.sft_examples):
        a, b = map(int, row["prompt"].removesuffix("=").split("+"))
        rows.append({**row, "carry_free_label": str(carry_free_sum(a, b))})
    return rows


def pick_carry_free(batch: Tensor, has_carry: Tensor, share: float, generator: torch.Generator) -> Tensor:
    """Row indices of a warm-start batch into ``[true rows, carry-free rows]``: each carry problem
    of ``batch`` takes its carry-free label with probability ``share``, drawn anew every time, so
    the model learns that mixture for every problem rather than which problems were mislabelled."""
    import torch

    flip = has_carry[batch] & (torch.rand(len(batch), generator=generator) < share)
    return batch + flip.long() * len(has_carry)


def warm_start(model_dir: str | Path, recipe: TinyModelRecipe, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the model in ``model_dir`` on the warm-start corpus in two phases and save it back.

    Phase 1 (``recipe.sft_steps`` at ``recipe.sft_lr``) teaches addition on true labels. Phase 2
    (``recipe.sft_mistake_steps`` at ``recipe.sft_mistake_lr``, fresh optimizer and schedule)
    teaches the carry-free mistake: each carry problem drawn takes its carry-free label with
    probability ``recipe.sft_carry_free_share``. Returns ``{"sft_examples", "final_loss", "seconds"}``."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    start = time.monotonic()
    model_dir = Path(model_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = sft_rows(recipe)
    mistaken = [{**r, "label": r["carry_free_label"]} for r in rows]
    tensors = _sft_tensors(tokenizer, rows + mistaken)
    has_carry = torch.tensor([r["label"] != r["carry_free_label"] for r in rows])
    generator = torch.Generator().manual_seed(recipe.seed)
    model.train()
    final_loss = float("nan")
    phases = (
        ("addition", recipe.sft_steps, recipe.sft_lr, 0.0),
        ("carry-free mistake", recipe.sft_mistake_steps, recipe.sft_mistake_lr, recipe.sft_carry_free_share),
    )
    for name, steps, lr, share in phases:
        if steps > 0:

            def report(step: int, loss: float, name: str = name, steps: int = steps) -> None:
                log(f"warm start ({name}): step {step}/{steps} loss {loss:.4f} elapsed {time.monotonic() - start:.1f}s")

            final_loss = _sft_phase(model, tensors, has_carry, steps, lr, share, recipe.sft_batch_size, generator, report)
    model.eval()
    model.save_pretrained(model_dir)
    return {"sft_examples": len(rows), "final_loss": final_loss, "seconds": time.monotonic() - start}


def _sft_phase(
    model: PreTrainedModel,
    tensors: tuple[Tensor, Tensor, Tensor],
    has_carry: Tensor,
    steps: int,
    lr: float,
    share: float,
    batch_size: int,
    generator: torch.Generator,
    report: Callable[[int, float], None],
) -> float:
    """``steps`` AdamW steps (warmup, cosine decay to 0) over shuffled epochs; returns the mean loss
    of the last logging window."""
    import torch

    ids, attention, labels = tensors
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine_schedule(steps))
    n, size = len(has_carry), batch_size
    order, cursor, window = torch.randperm(n, generator=generator), 0, []
    log_every, mean_loss = max(1, steps // 10), float("nan")
    from miles_core.stopping import RunStopped, stop_requested

    for step in range(1, steps + 1):
        if stop_requested():  # Ctrl-C of `miles train` during the warm start: nothing is cached
            raise RunStopped(f"stopped while building the starting model (warm start step {step} of {steps}); "
                             "nothing was saved: the next run builds it again")
        if cursor + size > n:  # a new epoch: reshuffle
            order, cursor = torch.randperm(n, generator=generator), 0
        batch = pick_carry_free(order[cursor : cursor + size], has_carry, share, generator)
        cursor += size
        loss = model(input_ids=ids[batch], attention_mask=attention[batch], labels=labels[batch]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        window.append(loss.item())
        if step % log_every == 0 or step == steps:
            mean_loss, window = sum(window) / len(window), []
            report(step, mean_loss)
    return mean_loss


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    rows: Sequence[dict[str, str]],
    max_new_tokens: int = 8,
    batch_size: int = 256,
) -> float:
    """Share of ``rows`` whose greedy response (left-padded batches) exactly matches the label."""
    import torch

    from miles_core.data.toy import toy_reward

    if not rows:
        raise ValueError("greedy_accuracy: no rows to evaluate")
    correct = 0.0
    with torch.no_grad():
        for first in range(0, len(rows), batch_size):
            chunk = rows[first : first + batch_size]
            prompts = [r["prompt"] for r in chunk]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            out = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(toy_reward(t, r["label"]) for t, r in zip(texts, chunk))
    return correct / len(rows)


# ------------------------------------------------------------------------------------ the cache


def recipe_hash(recipe: TinyModelRecipe) -> str:
    """Content address of a recipe: sha256 of its JSON and of ``RECIPE_CODE_VERSION`` (16 hex digits)."""
    payload = json.dumps({"recipe": recipe.model_dump(mode="json"), "code": RECIPE_CODE_VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def ensure_tiny(recipe: TinyModelRecipe, cache_dir: Path, log: Callable[[str], None], shipped: bool) -> Path:
    """The cached built-in tiny model of ``recipe`` (copied from the shipped build, if there is one and
    ``shipped``, else built)."""
    final = cache_dir / f"tiny-addition-{recipe_hash(recipe)}"
    if (final / COMPLETE_MARKER).is_file():
        log(f"tiny model: using cached {final}")
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    # One builder per recipe at a time; a waiting caller then finds the marker and builds nothing.
    with open(cache_dir / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / COMPLETE_MARKER).is_file():
            log(f"tiny model: using cached {final} (built by another process)")
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=cache_dir))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            ready = SHIPPED / final.name
            if shipped and ready.is_dir():
                for file in ready.iterdir():
                    shutil.copyfile(file, tmp / file.name)
                (tmp / COMPLETE_MARKER).write_text(recipe_hash(recipe) + "\n")
                log(f"tiny model: the shipped build of recipe {recipe_hash(recipe)} (`miles build-model --no-shipped` "
                    "builds it from the recipe instead, ~2 min)")
            else:
                _build(recipe, tmp, log)
            _publish(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"tiny model: {final}")
    return final


def _build(recipe: TinyModelRecipe, out: Path, log: Callable[[str], None]) -> None:
    """Untrained model, warm start, held-out greedy accuracy, report; the marker last."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from miles_core.config import ToyDataConfig
    from miles_core.data.toy import toy_problems

    from miles_core.threads import one_thread

    log(f"tiny model: building recipe {recipe.model_dump_json()} in {out}")
    build_untrained(recipe, out)
    with one_thread():  # as fast as two on an idle machine, several times faster on a busy one
        report = warm_start(out, recipe, log)
    start = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    held_out = toy_problems(ToyDataConfig(max_operand=recipe.max_operand), "test")
    accuracy = greedy_accuracy(model, tokenizer, held_out)
    log(f"tiny model: held-out greedy accuracy {accuracy:.3f} on {len(held_out)} problems")
    report = {
        "recipe": recipe.model_dump(mode="json"),
        "recipe_code_version": RECIPE_CODE_VERSION,
        "sft_examples": report["sft_examples"],
        "sft_final_loss": report["final_loss"],
        "warm_start_seconds": report["seconds"],
        "eval_seconds": time.monotonic() - start,
        "held_out_greedy_accuracy": accuracy,
        "held_out_problems": len(held_out),
    }
    (out / "warm_start.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / COMPLETE_MARKER).write_text(recipe_hash(recipe) + "\n")


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final``, first moving aside an incomplete ``final``."""
    if final.exists() and not (final / COMPLETE_MARKER).is_file():
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(tmp, final)
