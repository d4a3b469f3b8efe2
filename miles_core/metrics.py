"""Evaluation metrics: pass@k (unbiased estimator), the summary of an evaluated batch
(``eval_metrics``), and one evaluation's row over several datasets (``eval_row``); ``quantile``."""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

from miles_core.types import Group, SampleStatus


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the element at rank ``q * n``, no interpolation; 0.0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is
    correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def eval_metrics(groups: Sequence[Group], weight_version: int) -> dict[str, float]:
    """Mean reward, accuracy (mean per-prompt share of correct samples), pass@k for k = 1, 2, 4, ...
    up to the samples per prompt, response length, truncation ratio and the weight version."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        raise ValueError("eval_metrics: no samples to evaluate")
    n = min(len(g.samples) for g in groups)
    correct = [sum(s.is_correct for s in g.samples[:n]) for g in groups]
    rewards = [s.reward for s in samples if s.reward is not None]
    out = {
        "accuracy": sum(c / n for c in correct) / len(groups),
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "response_len_mean": sum(len(s.response_ids) for s in samples) / len(samples),
        "truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
        "failed_samples": float(sum(s.status == SampleStatus.FAILED for s in samples)),
        "num_prompts": float(len(groups)),
        "weight_version": float(weight_version),
    }
    k = 1
    while k <= n:
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(groups)
        k *= 2
    return out


def eval_row(per_dataset: dict[str, dict[str, float]], named: bool) -> dict[str, float]:
    """One evaluation's row from each dataset's ``eval_metrics`` (in the config's order): the first
    dataset's metrics under the plain keys (the run's headline: ``accuracy``, ``pass@1``, ...) and,
    when ``named``, every dataset's also as ``<name>/<metric>`` (``gsm8k/accuracy``).
    ``weight_version`` stays plain only: one version is evaluated on all of them."""
    if not per_dataset:
        raise ValueError("eval_row: no datasets were evaluated")
    row = dict(next(iter(per_dataset.values())))
    if named:
        for name, metrics in per_dataset.items():
            row.update({f"{name}/{key}": value for key, value in metrics.items() if key != "weight_version"})
    return row
