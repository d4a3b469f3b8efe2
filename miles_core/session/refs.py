"""Where a run lives, and the small JSON-able references its steps return (never tensors or samples)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunRefs:
    """Where a run lives: what every task needs besides the config."""

    run_id: str
    run_dir: str
    model_dir: str


@dataclass
class RolloutRef:
    step: int
    offset: int
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)
    source_state: dict[str, Any] = field(default_factory=dict)
    """The prompt cursor right after this rollout drew its prompts (what a checkpoint keeps)."""
    reward_errors: list[str] = field(default_factory=list)
    """The first few reward failures of this rollout (``metrics["reward_failed"]`` counts them all)."""


@dataclass
class TrainRef:
    step: int
    version: int
    weights_uri: str
    metrics: dict[str, float] = field(default_factory=dict)
    reward_errors: list[str] = field(default_factory=list)
    """Fully async: the first few reward failures among the groups trained on."""
