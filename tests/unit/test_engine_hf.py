"""HFEngine: the engine contract on the tiny model, plus what is particular to the in-process engine."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from contract.engine_contract import (
    PROMPTS,
    EngineContract,
    greedy_params,
    perturbed_state,
    requests,
    save_snapshot,
    seeded_params,
)

from waiting import eventually

from miles_core.config import HFEngineConfig
from miles_core.engines import setup_engine
from miles_core.engines.base import GenerateRequest, SamplingParams

torch.set_num_threads(1)
# ``contract`` resolves because pytest puts tests/ (home of the rootless conftest.py) on sys.path.


class TestHFEngineContract(EngineContract):
    def make_engine(self, model_dir: str, seed: int = 0):
        from miles_core.engines.hf import HFEngine

        return HFEngine(model_dir, HFEngineConfig(max_batch_size=64), seed=seed)


@pytest.fixture
def engine(tiny_model_dir):
    eng = setup_engine(HFEngineConfig(), str(tiny_model_dir), "float32", 0)
    yield eng
    asyncio.run(eng.close())


def test_setup_engine_builds_the_hf_engine(engine):
    from miles_core.engines.hf import HFEngine

    assert isinstance(engine, HFEngine)
    assert engine.tokenizer.eos_token_id == 1


def test_setup_engine_rejects_an_unknown_config(tiny_model_dir):
    with pytest.raises(TypeError, match="no rollout engine for config dict"):
        setup_engine({"type": "hf"}, str(tiny_model_dir))


# ------------------------------------------------------------------------------------ LoRA


def make_adapter(model_dir, folder, seed: int, rank: int = 4) -> str:
    """A LoRA adapter of the tiny model in PEFT's folder format, with random (non-zero) weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(folder)
    return str(folder)


def _greedy(engine, adapter=None, prompts=PROMPTS):
    reqs = [GenerateRequest(r.prompt_ids, greedy_params(), rid=r.rid, adapter=adapter)
            for r in requests(engine.tokenizer, greedy_params(), prompts)]
    return asyncio.run(engine.generate(reqs))


def _flat(results) -> list[float]:
    return [x for r in results for x in r.logprobs]


def test_adapters_serve_by_name_beside_the_base_in_one_batch(tiny_model_dir, engine, tmp_path):
    base_before = _greedy(engine)
    a = make_adapter(tiny_model_dir, tmp_path / "math", seed=1)
    b = make_adapter(tiny_model_dir, tmp_path / "code", seed=2)
    asyncio.run(engine.load_adapter("math", a))
    asyncio.run(engine.load_adapter("code", b))
    assert engine.adapters == ["code", "math"]
    alone = {name: _greedy(engine, name) for name in ("math", "code")}
    assert [r.output_ids for r in _greedy(engine)] == [r.output_ids for r in base_before], "the base is unchanged"
    assert [r.logprobs for r in alone["math"]] != [r.logprobs for r in base_before], "an adapter changes the policy"
    assert [r.logprobs for r in alone["math"]] != [r.logprobs for r in alone["code"]]

    # one call mixing base, a and b: each row gets exactly what it gets alone (no merging)
    tok = engine.tokenizer
    mixed = [GenerateRequest(tok.encode(PROMPTS[0]), greedy_params(), rid=name or "base", adapter=name)
             for name in (None, "math", "code")]
    dispatches = engine.stats.batches_run
    got = asyncio.run(engine.generate(mixed))
    assert engine.stats.batches_run == dispatches + 1, "base and adapters share one batch"
    for result, want in zip(got, (base_before[0], alone["math"][0], alone["code"][0])):
        assert result.output_ids == want.output_ids
        assert result.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_loading_an_adapter_again_replaces_it(tiny_model_dir, engine, tmp_path):
    asyncio.run(engine.load_adapter("math", make_adapter(tiny_model_dir, tmp_path / "a1", seed=1), version=3))
    first = _greedy(engine, "math")
    asyncio.run(engine.load_adapter("math", make_adapter(tiny_model_dir, tmp_path / "a2", seed=7, rank=8), version=4))
    second = _greedy(engine, "math")
    # each result says which version of its weights made it: the adapter's, or the base's
    assert {r.weight_version for r in first} == {3} and {r.weight_version for r in second} == {4}
    assert {r.weight_version for r in _greedy(engine)} == {0}
    asyncio.run(engine.load_adapter("other", make_adapter(tiny_model_dir, tmp_path / "a1b", seed=1)))
    assert _flat(_greedy(engine, "other")) == pytest.approx(
        _flat(first)), "the same adapter files give the same policy under any name"
    assert [r.logprobs for r in second] != [r.logprobs for r in first]
    assert engine.adapters == ["math", "other"]


def test_a_request_during_an_adapter_replacement_waits_for_the_new_version(tiny_model_dir, engine, tmp_path):
    """Replacing an adapter removes its name from the model for a moment (under the engine's lock);
    a request for it arriving then is not refused: it waits and runs on the new version."""
    import threading

    asyncio.run(engine.load_adapter("math", make_adapter(tiny_model_dir, tmp_path / "v1", seed=1), version=1))
    v2 = make_adapter(tiny_model_dir, tmp_path / "v2", seed=2)
    install, mid_replacement, release = engine._install_adapter, threading.Event(), threading.Event()

    def held_install(name, uri):  # the replacement, held between removing the old version and adding the new
        engine.model.delete_adapter(name)
        mid_replacement.set()
        release.wait(30)
        install(name, uri)

    engine._install_adapter = held_install
    prompt = engine.tokenizer.encode(PROMPTS[0])

    async def scenario():
        load = asyncio.ensure_future(engine.load_adapter("math", v2, version=2))
        assert await asyncio.to_thread(mid_replacement.wait, 30)
        assert "math" not in engine.adapters  # the name is gone from the model right now
        received = engine.stats.requests_received
        got = asyncio.ensure_future(engine.generate([GenerateRequest(prompt, greedy_params(), rid="r", adapter="math")]))
        await eventually(lambda: engine.stats.requests_received > received, what="the request reaches the engine")
        release.set()
        await load
        return await got

    (result,) = asyncio.run(scenario())
    assert result.weight_version == 2


def test_adapters_load_from_a_weight_store_version_and_survive_base_updates(tiny_model_dir, engine, tmp_path):
    from miles_core.storage import WeightStore

    store = WeightStore("memory://adapters-test/weights")
    uri = store.publish_folder(1, make_adapter(tiny_model_dir, tmp_path / "math", seed=3))
    asyncio.run(engine.load_adapter("math", uri))
    with_adapter = _greedy(engine, "math")
    # a base update with the adapter loaded: the base changes, the adapter stays loaded
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    snapshot = save_snapshot(perturbed_state(base, 0.5), tmp_path / "v1.safetensors", drop_tied=False)
    asyncio.run(engine.update_weights(str(snapshot), 1))
    assert engine.adapters == ["math"] and engine.weight_version == 1
    assert [r.logprobs for r in _greedy(engine, "math")] != [r.logprobs for r in with_adapter]
    back = save_snapshot(base.state_dict(), tmp_path / "v2.safetensors", drop_tied=False)
    asyncio.run(engine.update_weights(str(back), 2))  # back to the starting base weights
    assert _flat(_greedy(engine, "math")) == pytest.approx(_flat(with_adapter), abs=1e-6)


def test_adapter_errors_are_clear(engine, tmp_path):
    with pytest.raises(ValueError, match="adapter 'math', which is not loaded \\(loaded: none\\)"):
        asyncio.run(engine.generate([GenerateRequest([5], adapter="math")]))
    with pytest.raises(FileNotFoundError, match="adapter folder not found"):
        asyncio.run(engine.load_adapter("math", str(tmp_path / "nowhere")))
    for bad in ("__base__", "a", ""):
        with pytest.raises(ValueError, match="reserved, empty or part of PEFT's 'lora_' prefix"):
            asyncio.run(engine.load_adapter(bad, str(tmp_path)))


def test_batch_size_does_not_change_outputs(tiny_model_dir, engine):
    small = setup_engine(HFEngineConfig(max_batch_size=2), str(tiny_model_dir))
    tok = engine.tokenizer
    reqs = requests(tok, greedy_params(), PROMPTS * 2) + requests(tok, seeded_params(), PROMPTS)
    assert [r.output_ids for r in asyncio.run(small.generate(reqs))] == [
        r.output_ids for r in asyncio.run(engine.generate(reqs))
    ]


def test_each_distinct_prompt_is_prefilled_once(engine):
    """n samples of a prompt decode from one prefill of it (as a prefix cache would serve them):
    the first forward pass of the batch has one row per distinct prompt, the outputs are those of
    the same requests one by one."""
    tok = engine.tokenizer
    reqs = [GenerateRequest(tok.encode(p), seeded_params(seed=i), rid=f"r{i}")  # 2 prompts x 4 samples
            for i, p in enumerate(PROMPTS[:2] * 4)]
    widths = []
    hook = engine.model.register_forward_hook(lambda m, args, kwargs, out: widths.append(kwargs["input_ids"].shape),
                                              with_kwargs=True)
    together = asyncio.run(engine.generate(reqs))
    hook.remove()
    assert widths[0][0] == 2 and all(w == (8, 1) for w in widths[1:2])
    one_by_one = [asyncio.run(engine.generate([q]))[0] for q in reqs]
    assert len({tuple(r.output_ids) for r in together[::2]}) > 1, "a prompt's samples differ: rows were not mixed up"
    assert [r.output_ids for r in together] == [r.output_ids for r in one_by_one]
    assert [r.logprobs for r in together] == [pytest.approx(r.logprobs, abs=1e-5) for r in one_by_one]


def test_update_weights_from_a_memory_folder(engine, tmp_path):
    import fsspec

    before = asyncio.run(engine.generate(requests(engine.tokenizer, seeded_params())))
    path = save_snapshot(perturbed_state(engine.model), tmp_path / "model.safetensors", drop_tied=True)
    with fsspec.open("memory://snapshots/v3/model.safetensors", "wb") as f:
        f.write(path.read_bytes())
    asyncio.run(engine.update_weights("memory://snapshots/v3", 3))
    after = asyncio.run(engine.generate(requests(engine.tokenizer, seeded_params())))
    assert engine.weight_version == 3
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    with pytest.raises(FileNotFoundError, match="memory://snapshots/none"):
        asyncio.run(engine.update_weights("memory://snapshots/none", 4))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(stop=("",)), "stop strings"),
    ],
)
def test_bad_sampling_params_raise(engine, bad, message):
    with pytest.raises(ValueError, match=message):
        asyncio.run(engine.generate(requests(engine.tokenizer, SamplingParams(**bad))))


def test_sample_tokens_by_hand():
    from miles_core.engines.hf_decode import sample_tokens

    # probabilities [0.5, 0.3, 0.15, 0.05]; T = 1 keeps them
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]]).repeat(2, 1)
    # top_p = 0.7: mass before each token is [0, 0.5, 0.8, 0.95], so the nucleus is {0, 1};
    # renormalised cdf [0.625, 1]: u = 0.6 picks token 0, u = 0.63 picks token 1
    p = SamplingParams(temperature=1.0, top_p=0.7)
    tokens, logprobs = sample_tokens(logits, p, torch.tensor([0.6, 0.63], dtype=torch.float64))
    assert tokens.tolist() == [0, 1]
    # reported logprobs are untruncated: log 0.5 and log 0.3 (not log 0.625, log 0.375)
    assert logprobs.tolist() == pytest.approx([math.log(0.5), math.log(0.3)], abs=1e-6)
    # top_k = 3: cdf [0.5, 0.8, 0.95] / 0.95 = [0.526, 0.842, 1]: u = 0.99 picks token 2, never 3
    tokens, _ = sample_tokens(logits, SamplingParams(top_k=3), torch.tensor([0.99, 0.9999999], dtype=torch.float64))
    assert tokens.tolist() == [2, 2]
    # T = 0.5 squares and renormalises: [0.25, 0.09, ...] / 0.365; logprob log(0.25 / 0.365)
    zeros = torch.zeros(2, dtype=torch.float64)
    tokens, logprobs = sample_tokens(logits, SamplingParams(temperature=0.5), zeros)
    total = 0.25 + 0.09 + 0.0225 + 0.0025
    assert tokens.tolist() == [0, 0]
    assert logprobs.tolist() == pytest.approx([math.log(0.25 / total)] * 2, abs=1e-6)


# ----------------------------------------------------------------------- coalescing of calls


def run_concurrently(engine, calls: list[list[GenerateRequest]]):
    async def body():
        return await asyncio.gather(*(engine.generate(reqs) for reqs in calls))

    return asyncio.run(body())


async def start_batch(engine, reqs: list[GenerateRequest]) -> asyncio.Task:
    """A ``generate`` task, returned once every request has its first token (later calls queue behind it)."""
    first_tokens = engine.stats.first_tokens
    task = asyncio.create_task(engine.generate(reqs))
    await eventually(lambda: engine.stats.first_tokens >= first_tokens + len(reqs), what="the batch decodes")
    return task


def test_concurrent_single_request_calls_share_batches(engine):
    # lengths, stop tokens and seeds vary: only temperature / top-p / top-k split a batch
    tok = engine.tokenizer
    params = [SamplingParams(max_new_tokens=4 + i % 5, seed=i, stop_token_ids=(i,)) for i in range(32)]
    reqs = [GenerateRequest(tok.encode(PROMPTS[i % 4]), p, rid=f"r{i}") for i, p in enumerate(params)]
    served, batches = engine.stats.calls_served, engine.stats.batches_run
    separate = [r for (r,) in run_concurrently(engine, [[q] for q in reqs])]
    assert engine.stats.calls_served - served == 32
    assert engine.stats.batches_run - batches <= 3  # one, unless a call missed the first dispatch
    together = asyncio.run(engine.generate(reqs))
    assert [r.output_ids for r in separate] == [r.output_ids for r in together]
    assert [r.logprobs for r in separate] == [pytest.approx(r.logprobs, abs=1e-5) for r in together]


def test_calls_spanning_chunks_get_their_own_rows(tiny_model_dir, engine):
    # chunks of 3 rows, sorted by prompt length across calls, so most calls span several chunks
    small = setup_engine(HFEngineConfig(max_batch_size=3), str(tiny_model_dir))
    tok = engine.tokenizer
    calls = [
        requests(tok, greedy_params(), PROMPTS),
        requests(tok, seeded_params(max_new_tokens=5), PROMPTS[2:]),
        requests(tok, greedy_params(max_new_tokens=3), PROMPTS[:1]),
        requests(tok, seeded_params(seed=3), PROMPTS[::-1]) + requests(tok, greedy_params(), PROMPTS[1:2]),
    ]
    coalesced = run_concurrently(small, calls)
    assert small.stats.dispatches == 1 and small.stats.batches_run >= 4
    for reqs, results in zip(calls, coalesced):
        alone = asyncio.run(engine.generate(reqs))
        assert [r.rid for r in results] == [q.rid for q in reqs]
        assert [r.output_ids for r in results] == [r.output_ids for r in alone]
    asyncio.run(small.close())


def test_pause_waits_for_the_running_batch_and_holds_calls_queued_behind_it(engine):
    tok = engine.tokenizer

    async def body():
        running = await start_batch(engine, requests(tok, greedy_params(max_new_tokens=300)))
        received = engine.stats.requests_received
        queued = asyncio.create_task(engine.generate(requests(tok, greedy_params(max_new_tokens=3))))
        await eventually(lambda: engine.stats.requests_received > received, what="the call is queued")
        await engine.pause()
        state = running.done(), queued.done(), engine.stats.dispatches
        await asyncio.sleep(0.05)  # the time it is held for
        held = not queued.done()
        await engine.resume()
        return state, held, await asyncio.wait_for(queued, 10)

    (running_done, queued_done, dispatches), held, queued = asyncio.run(body())
    assert running_done and not queued_done and dispatches == 1 and held
    assert all(r.finish_reason == "length" and len(r.output_ids) == 3 for r in queued)


def test_a_cancelled_call_leaves_the_running_batch(engine):
    # its rows would take minutes to finish: pause() returns only because they stopped
    async def body():
        task = await start_batch(engine, requests(engine.tokenizer, greedy_params(max_new_tokens=10**5)))
        task.cancel()
        await asyncio.wait_for(engine.pause(), 10)
        await engine.resume()
        return task.cancelled()

    assert asyncio.run(body())


def test_each_result_carries_the_version_of_the_weights_that_made_it(engine, tmp_path):
    tok = engine.tokenizer
    probe = requests(tok, seeded_params())
    v0 = asyncio.run(engine.generate(probe))
    path = save_snapshot(perturbed_state(engine.model), tmp_path / "model.safetensors", drop_tied=True)

    async def body():
        running = await start_batch(engine, requests(tok, greedy_params(max_new_tokens=300)))
        update = asyncio.create_task(engine.update_weights(str(path), 1))
        queued = asyncio.create_task(engine.generate(probe))  # runs before or after the load
        return await asyncio.wait_for(asyncio.gather(running, queued, update), 30)

    running, queued, _ = asyncio.run(body())
    v1 = asyncio.run(engine.generate(probe))
    assert {r.weight_version for r in running} == {0}  # in flight when the update began
    version = queued[0].weight_version
    assert {r.weight_version for r in queued} == {version}
    assert [r.output_ids for r in queued] == [r.output_ids for r in {0: v0, 1: v1}[version]]
    assert [r.output_ids for r in v1] != [r.output_ids for r in v0]
