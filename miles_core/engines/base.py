"""The RolloutEngine protocol and its request/result types.

The protocol is shaped after SGLang's HTTP server so that an out-of-process engine fits the same
methods: ``generate`` takes token ids and sampling params and returns output ids, per-token
logprobs, a finish reason (``stop`` | ``length`` | ``abort``) and the weight version that produced
the output; ``update_weights`` loads a safetensors snapshot by URI and version; ``pause`` / ``resume``
/ ``abort`` / ``health`` mirror ``/pause_generation``, ``/continue_generation``, ``/abort_request``
and ``/health``. All methods are async and must not block the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1: off."""
    stop: tuple[str, ...] = ()
    """Stop strings: the response ends after the first one (the stop string is kept)."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop tokens besides the tokenizer's EOS (the stop token is kept in output_ids)."""
    seed: int | None = None
    """Seed of this request's sampling (None: engine's own generator)."""


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    """Request id (for abort and logs)."""
    adapter: str | None = None
    """Name of a loaded LoRA adapter to generate with (None: base weights)."""


@dataclass
class GenerateResult:
    output_ids: list[int]
    text: str
    logprobs: list[float]
    """Log-probability of each output token under the weights that sampled it: the log-softmax of
    ``logits / temperature`` (raw logits when temperature is 0), before top-p/top-k truncation.
    The trainer computes its logprobs the same way, so the two agree when weights agree."""
    finish_reason: FinishReason
    weight_version: int
    """Version of the weights that generated it: the base weights' version, or for a request with
    an ``adapter``, the version that adapter was loaded as."""
    rid: str | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    @property
    def weight_version(self) -> int: ...

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]: ...

    async def update_weights(self, uri: str, version: int) -> None:
        """Load the safetensors snapshot at ``uri`` (a file or folder URL) as ``version``."""

    async def load_adapter(self, name: str, uri: str, version: int = 0) -> None:
        """Load (or replace) LoRA adapter ``name`` from a PEFT folder at ``uri`` as ``version``."""

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def abort(self) -> None: ...

    async def health(self) -> bool: ...

    async def close(self) -> None: ...
