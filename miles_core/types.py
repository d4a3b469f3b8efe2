"""Sample, Group, SampleStatus and the Arrow schema of a sample stream.

A ``Sample`` is one response to one prompt, with everything training needs (token ids, loss mask,
rollout logprobs, reward) and everything an analyst needs (status, weight versions, metadata).
A ``Group`` is the n samples of one prompt; GRPO normalises rewards within it.

``samples_to_table`` / ``table_to_samples`` convert to and from Arrow (pyarrow is imported on use,
so this module imports without pyarrow or torch).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

SCHEMA_VERSION = 2
"""2: ``submit_version`` added."""


class SampleStatus(str, enum.Enum):
    COMPLETED = "completed"
    """The response ended with a stop token or stop string."""
    TRUNCATED = "truncated"
    """The response hit the max response length."""
    ABORTED = "aborted"
    """Generation was aborted (engine pause/abort); the sample is not trained on as is."""
    FAILED = "failed"
    """Generation or reward failed; ``error`` says why."""


@dataclass
class Sample:
    prompt: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response: str = ""
    label: str | None = None
    reward: float | None = None
    loss_mask: list[int] = field(default_factory=list)
    """1 for response tokens the policy is trained on, 0 for tokens it is not (e.g. tool output)."""
    rollout_logprobs: list[float] = field(default_factory=list)
    """Log-probability of each response token under the engine's weights when it was sampled."""
    span_starts: list[int] = field(default_factory=lambda: [0])
    """Response-token index where each generated span starts."""
    span_versions: list[int] = field(default_factory=lambda: [0])
    """Weight version that generated each span (same length as ``span_starts``)."""
    submit_version: int = 0
    """The engine's weight version when the sample was submitted (its staleness baseline)."""
    status: SampleStatus = SampleStatus.COMPLETED
    group_index: int = 0
    """Index of the group (prompt) within the run."""
    sample_index: int = 0
    """Index of the sample within its group."""
    prompt_index: int = -1
    """Row of the prompt in its dataset."""
    adapter: str | None = None
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def is_correct(self) -> bool:
        """Verifiable rewards score 1 for a correct answer; accuracy counts those samples."""
        return self.reward is not None and self.reward >= 1.0


@dataclass
class Group:
    samples: list[Sample]

    @property
    def group_index(self) -> int:
        return self.samples[0].group_index

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]


def flatten(groups: list[Group]) -> list[Sample]:
    return [s for g in groups for s in g.samples]


def regroup(samples: list[Sample]) -> list[Group]:
    """Samples back into groups by ``group_index``, in order of first appearance."""
    by_index: dict[int, list[Sample]] = {}
    for s in samples:
        by_index.setdefault(s.group_index, []).append(s)
    return [Group(sorted(v, key=lambda s: s.sample_index)) for v in by_index.values()]


# ----------------------------------------------------------------------------------------- arrow


def arrow_schema() -> pa.Schema:
    import pyarrow as pa

    ints = pa.list_(pa.int32())
    return pa.schema(
        [
            ("prompt", pa.string()),
            ("prompt_ids", ints),
            ("response_ids", ints),
            ("response", pa.string()),
            ("label", pa.string()),
            ("reward", pa.float32()),
            ("loss_mask", pa.list_(pa.int8())),
            ("rollout_logprobs", pa.list_(pa.float32())),
            ("span_starts", ints),
            ("span_versions", ints),
            ("submit_version", pa.int32()),
            ("status", pa.string()),
            ("group_index", pa.int64()),
            ("sample_index", pa.int32()),
            ("prompt_index", pa.int64()),
            ("adapter", pa.string()),
            ("error", pa.string()),
            ("metadata", pa.string()),
        ],
        metadata={b"miles.schema_version": str(SCHEMA_VERSION).encode()},
    )


def samples_to_table(samples: list[Sample]) -> pa.Table:
    import pyarrow as pa

    cols: dict[str, list[Any]] = {name: [] for name in arrow_schema().names}
    for s in samples:
        for name in cols:
            value = getattr(s, name)
            if name == "status":
                value = SampleStatus(value).value
            elif name == "metadata":
                value = json.dumps(value, sort_keys=True)
            cols[name].append(value)
    return pa.Table.from_pydict(cols, schema=arrow_schema())


def table_to_samples(table: pa.Table) -> list[Sample]:
    version = (table.schema.metadata or {}).get(b"miles.schema_version", b"?").decode()
    if version != str(SCHEMA_VERSION):
        raise ValueError(f"sample table has schema version {version!r}; this code reads {SCHEMA_VERSION}")
    rows = table.to_pylist()
    out = []
    for r in rows:
        r["status"] = SampleStatus(r["status"])
        r["metadata"] = json.loads(r["metadata"]) if r["metadata"] else {}
        out.append(Sample(**r))
    return out
