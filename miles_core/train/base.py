"""The Trainer protocol and the batch it trains on.

- ``TrainBatch``: the samples of one training step, one advantage per sample (``from_groups``: the
  estimator of the loss config), and the rollout
  temperature (the trainer computes logprobs of ``logits / temperature``, as the engine did).
- ``Trainer``: ``step(batch) -> metrics``; ``export(version) -> uri`` publishes the policy weights
  (with LoRA: the adapter, in PEFT's folder format) to the run's WeightStore; ``state_dict()`` / ``load_state_dict()`` are the full training state
  (weights, optimizer, version, RNG); ``save(uri)`` / ``load(uri)`` write and read it over fsspec.

Version v is the policy after v optimizer steps (the same numbering as the WeightStore).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_core.types import Group, Sample, flatten

if TYPE_CHECKING:
    from miles_core.config import LossConfig


@dataclass
class TrainBatch:
    samples: list[Sample]
    advantages: list[float]
    """One advantage per sample (broadcast over its response tokens)."""
    temperature: float = 1.0
    """Rollout temperature the samples were drawn at (0 or less: logprobs of the raw logits)."""
    group_sizes: list[int] | None = None
    """Samples per group, in order (``from_groups`` sets it): the trainer needs the groups again to
    recompute advantages from KL-penalised rewards (``train.kl_coef``)."""

    def __post_init__(self) -> None:
        if len(self.samples) != len(self.advantages):
            raise ValueError(
                f"TrainBatch has {len(self.samples)} samples but {len(self.advantages)} advantages"
            )

    @classmethod
    def from_groups(
        cls, groups: Sequence[Group], temperature: float, loss: LossConfig | None = None
    ) -> TrainBatch:
        """Advantages of ``groups`` for ``loss`` (None: the default, GRPO); samples with reward None
        get advantage 0 (and train nothing)."""
        from miles_core.config import GRPOLossConfig
        from miles_core.train.advantages import compute_advantages

        advantages = compute_advantages(loss or GRPOLossConfig(), groups)
        return cls(flatten(list(groups)), advantages, temperature, [len(g.samples) for g in groups])

    def regrouped(self, rewards: Sequence[float | None]) -> list[Group]:
        """The batch's groups again, with ``rewards`` (one per sample, in order) in place of theirs."""
        from dataclasses import replace

        if self.group_sizes is None or sum(self.group_sizes) != len(self.samples):
            raise ValueError("this TrainBatch has no group structure: build it with TrainBatch.from_groups")
        samples = [replace(s, reward=r) for s, r in zip(self.samples, rewards, strict=True)]
        groups, start = [], 0
        for n in self.group_sizes:
            groups.append(Group(samples[start : start + n]))
            start += n
        return groups


@runtime_checkable
class Trainer(Protocol):
    @property
    def version(self) -> int:
        """Optimizer steps taken so far (plus the version the trainer started at)."""

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """Train on ``batch`` (one or more optimizer steps); return metrics averaged over them."""

    def export(self, version: int) -> str:
        """Publish the current policy weights as ``version``; return the snapshot's URI."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: weights, optimizer state, version, RNG states."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save(self, uri: str) -> None:
        """Write ``state_dict()`` to ``uri`` (any fsspec URL)."""

    def load(self, uri: str) -> None:
        """Restore the state written by ``save(uri)``."""
