"""``AdapterPolicy``: a run's LoRA adapter seen as an engine. Requests go to the adapter once it is
loaded (to the base before), pushes load it by name, and versions are the adapter's."""

from __future__ import annotations

import asyncio

from doubles.scripted_engine import ScriptedEngine

from miles_core.engines.base import GenerateRequest, SamplingParams
from miles_core.engines.policy import AdapterPolicy


def _requests(n: int, adapter: str | None = None) -> list[GenerateRequest]:
    return [GenerateRequest([1, 2, i], SamplingParams(max_new_tokens=3), rid=f"r{i}", adapter=adapter) for i in range(n)]


def test_requests_go_to_the_base_until_the_adapter_is_pushed_then_to_the_adapter():
    async def scenario():
        engine = ScriptedEngine()
        await engine.update_weights("base-v5", 5)  # the base's own version is not the policy's
        await engine.load_adapter("other", "weights/other", 9)
        policy = AdapterPolicy(engine, "policy")
        assert policy.weight_version == 0
        before = await policy.generate(_requests(2))
        await policy.update_weights("weights/v000003", 3)
        after = await policy.generate(_requests(2) + _requests(1, adapter="other"))
        return engine, policy, before, after

    engine, policy, before, after = asyncio.run(scenario())
    assert [r.adapter for r in engine.requests] == [None, None, "policy", "policy", "other"]
    assert [r.weight_version for r in before] == [0, 0], "version 0 of the policy is the base"
    assert [r.weight_version for r in after] == [3, 3, 9], "a request naming an adapter keeps it"
    assert engine.adapter_loads[-1] == ("policy", "weights/v000003", 3) and engine.loads == [("base-v5", 5)]
    assert policy.weight_version == 3 and engine.weight_version == 5


def test_results_carry_the_adapter_version_and_a_push_of_version_0_goes_back_to_the_base():
    async def scenario():
        engine = ScriptedEngine()
        policy = AdapterPolicy(engine, "policy")
        await policy.update_weights("weights/v000001", 1)
        await policy.update_weights("weights/v000002", 2)
        v2 = await policy.generate(_requests(3))
        await policy.update_weights("ignored: version 0 is the base", 0)  # a run rolled back to its start
        v0 = await policy.generate(_requests(1))
        return engine, policy, v2, v0

    engine, policy, v2, v0 = asyncio.run(scenario())
    assert [r.weight_version for r in v2] == [2, 2, 2]
    assert [r.weight_version for r in v0] == [0] and engine.requests[-1].adapter is None
    assert policy.weight_version == 0
    assert [load[2] for load in engine.adapter_loads] == [1, 2], "version 0 reads nothing"


def test_engine_calls_and_extras_pass_through():
    async def scenario():
        engine = ScriptedEngine()
        policy = AdapterPolicy(engine, "policy")
        assert await policy.health()
        await policy.load_adapter("second", "weights/x", 7)
        await policy.close()
        return engine, policy

    engine, policy = asyncio.run(scenario())
    assert engine.adapter_versions == {"second": 7} and engine.closed
    assert policy.peak_running == engine.peak_running  # engine-specific attributes
