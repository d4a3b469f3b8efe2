"""The remote reward (``rollout.reward = "remote"``, Miles' ``--rm-type remote_rm --rm-url URL``).

Each sample is POSTed to ``rollout.rm_url`` as JSON, ``{"prompt", "response", "label", "metadata"}``,
and the answer is its reward: a JSON number, or an object with a ``"reward"`` (or ``"score"``)
number; ``MILES_RM_AUTHORIZATION`` in the environment, if set, is sent as the ``Authorization``
header (credentials never go in the URL, which is stored with the run's config). A connection
error, a timeout or a 5xx answer is tried again (``ATTEMPTS`` in all, waiting
``BACKOFF_S`` between them); a 4xx answer or a body that is not a number fails the sample at once,
naming the endpoint (without credentials or query), the status and the start of the body. The
call as a whole has the run's reward deadline (``rollout.reward_timeout_s``), like any reward.
"""

from __future__ import annotations

import asyncio
import numbers
import os
from typing import Any
from urllib.parse import urlsplit

from miles_core.types import Sample

ATTEMPTS = 3
BACKOFF_S = (0.5, 1.0)
"""Seconds to wait before the second and the third attempt."""
REQUEST_TIMEOUT_S = 30.0
"""One request's limit (connect, read); the call's own deadline is the run's reward timeout."""


class RemoteRewardError(RuntimeError):
    pass


def endpoint(url: str) -> str:
    """``url`` as logs and errors may show it: no user, password or query (they may hold secrets)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


class RemoteReward:
    """An async per-sample reward function over an HTTP endpoint (module docstring)."""

    def __init__(self, url: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"rollout.rm_url={endpoint(url)!r} must start with http:// or https://")
        self.url = url
        self.__name__ = self.__qualname__ = f"remote reward at {endpoint(url)}"

    async def __call__(self, sample: Sample) -> float:
        import httpx

        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
                   "metadata": sample.metadata}
        auth = os.environ.get("MILES_RM_AUTHORIZATION")
        headers = {"Authorization": auth} if auth else {}
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, headers=headers) as client:  # bound to its loop
            return await self._post(client, payload)

    async def _post(self, client: Any, payload: dict[str, Any]) -> float:
        import httpx

        last = ""
        for attempt in range(ATTEMPTS):
            if attempt:
                await asyncio.sleep(BACKOFF_S[min(attempt - 1, len(BACKOFF_S) - 1)])
            try:
                answer = await client.post(self.url, json=payload)
            except httpx.TransportError as e:  # connection refused or reset, a timeout: try again
                last = f"{type(e).__name__}: {e}"
                continue
            if answer.status_code >= 500:
                last = f"HTTP {answer.status_code}: {answer.text[:200]!r}"
                continue
            if answer.status_code >= 400:
                raise RemoteRewardError(f"{endpoint(self.url)} answered HTTP {answer.status_code}: {answer.text[:200]!r}")
            return _reward_of(answer, self.url)
        raise RemoteRewardError(f"{endpoint(self.url)} failed {ATTEMPTS} times; the last: {last}")


def _reward_of(answer: Any, url: str) -> float:
    try:
        body = answer.json()
    except ValueError:
        body = None
    value = body.get("reward", body.get("score")) if isinstance(body, dict) else body
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RemoteRewardError(f"{endpoint(url)} answered {answer.text[:200]!r}: expected a number, or an object "
                                "with a 'reward' number")
    return float(value)
