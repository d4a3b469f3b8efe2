"""``AdapterPolicy``: one LoRA adapter of an engine, seen as an engine of its own.

A run that trains a LoRA adapter generates with that adapter and pushes each new version of it by
name, while the engine's base weights never change. ``AdapterPolicy(engine, name)`` wraps the engine
so that everything written against the ``RolloutEngine`` protocol (rollouts, the fully-async
producer, evaluation, custom generate functions) does that without knowing about adapters:

- ``generate`` sends every request that names no adapter to adapter ``name`` (requests that name
  one keep it); before the first push, version 0, they go to the base, which is what an adapter
  with ``B = 0`` computes anyway;
- ``update_weights(uri, version)`` loads the PEFT folder at ``uri`` as adapter ``name``, version
  ``version`` (``engine.load_adapter``); version 0 switches back to the base (a run rolled back to
  its start), without touching the engine's base weights;
- ``weight_version`` is the adapter's version, so staleness is measured against the adapter.

Several ``AdapterPolicy`` views can share one engine (one per adapter).
"""

from __future__ import annotations

from dataclasses import replace

from miles_core.engines.base import GenerateRequest, GenerateResult, RolloutEngine


class AdapterPolicy:
    def __init__(self, engine: RolloutEngine, adapter: str) -> None:
        self.engine = engine
        self.adapter = adapter
        self._version = 0
        self._loaded = False
        """Whether requests go to the adapter (False: version 0, the base)."""

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        adapter = self.adapter if self._loaded else None
        routed = [req if req.adapter is not None else replace(req, adapter=adapter) for req in requests]
        results = await self.engine.generate(routed)
        if not self._loaded:  # base rows carry the base's version; version 0 of the policy is the base
            for req, result in zip(routed, results):
                if req.adapter is None:
                    result.weight_version = 0
        return results

    async def update_weights(self, uri: str, version: int) -> None:
        """Load version ``version`` of the adapter from the PEFT folder at ``uri``; version 0 is the
        base (``uri`` is not read) and routes requests back to it."""
        if version == 0:
            self._loaded, self._version = False, 0
            return
        await self.engine.load_adapter(self.adapter, uri, version)
        self._loaded, self._version = True, version

    async def load_adapter(self, name: str, uri: str, version: int = 0) -> None:
        await self.engine.load_adapter(name, uri, version)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def abort(self) -> None:
        await self.engine.abort()

    async def health(self) -> bool:
        return await self.engine.health()

    async def close(self) -> None:
        await self.engine.close()

    def __getattr__(self, name: str):
        # engine-specific extras (``stats``, ``adapters``, ``url``) pass through
        return getattr(self.engine, name)
