"""A test double of the RolloutEngine protocol with latency and failures under test control.

It behaves like a continuous-batching server (SGLang): every request generates concurrently, one
token every ``token_latency`` seconds; ``pause`` holds new requests and waits for running ones;
``abort`` returns every running request at once with the tokens so far (finish reason ``abort``);
``update_weights`` waits until nothing runs (new requests wait for it) and stamps later results
with the new version; ``load_adapter`` does the same for requests naming that adapter. ``script(request) -> list[int]`` decides a request's full output (default:
``default_tokens`` tokens); ``fail(request) -> Exception | None`` makes a request raise.
It records what tests assert on: peak concurrent requests, calls, weight loads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from miles_core.engines.base import GenerateRequest, GenerateResult


class ScriptedEngine:
    def __init__(
        self,
        token_latency: float = 0.001,
        script: Callable[[GenerateRequest], list[int]] | None = None,
        fail: Callable[[GenerateRequest], Exception | None] | None = None,
        default_tokens: int = 4,
    ) -> None:
        self.token_latency = token_latency
        self.script = script or (lambda req: [1 + (len(req.prompt_ids) + i) % 7 for i in range(default_tokens)])
        self.fail = fail
        self._version = 0
        self._running = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._abort_epoch = 0
        self.peak_running = 0
        self.tokens_out = 0
        self.requests: list[GenerateRequest] = []
        self.loads: list[tuple[str, int]] = []
        self.adapter_loads: list[tuple[str, str, int]] = []
        self.adapter_versions: dict[str, int] = {}
        self.closed = False

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def _one(self, req: GenerateRequest) -> GenerateResult:
        epoch = self._abort_epoch
        await self._open.wait()
        if epoch != self._abort_epoch:
            return GenerateResult([], "", [], "abort", self._version, req.rid)
        self.requests.append(req)
        error = self.fail(req) if self.fail else None
        if error is not None:
            raise error
        self._running += 1
        self._idle.clear()
        self.peak_running = max(self.peak_running, self._running)
        if req.adapter is not None and req.adapter not in self.adapter_versions:
            raise ValueError(f"adapter {req.adapter!r} is not loaded")
        version = self._version if req.adapter is None else self.adapter_versions[req.adapter]
        epoch = self._abort_epoch
        full = self.script(req)
        out: list[int] = []
        finish = "stop"
        try:
            for token in full:
                if len(out) >= req.sampling.max_new_tokens:
                    finish = "length"
                    break
                await asyncio.sleep(self.token_latency)
                if epoch != self._abort_epoch:
                    finish = "abort"
                    break
                out.append(token)
                self.tokens_out += 1
            else:
                finish = "length" if len(out) >= req.sampling.max_new_tokens else "stop"
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()
        text = "".join(chr(ord("a") + t % 26) for t in out)
        return GenerateResult(out, text, [-0.5] * len(out), finish, version, req.rid)

    async def update_weights(self, uri: str, version: int) -> None:
        self._open.clear()
        try:
            await self._idle.wait()
            self.loads.append((uri, version))
            self._version = version
        finally:
            self._open.set()

    async def load_adapter(self, name: str, uri: str, version: int = 0) -> None:
        """Like ``update_weights``, for adapter ``name``; its requests' results carry ``version``."""
        self._open.clear()
        try:
            await self._idle.wait()
            self.adapter_loads.append((name, uri, version))
            self.adapter_versions[name] = version
        finally:
            self._open.set()

    async def pause(self) -> None:
        self._open.clear()
        await self._idle.wait()

    async def resume(self) -> None:
        self._open.set()

    async def abort(self) -> None:
        self._abort_epoch += 1

    async def health(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed = True
