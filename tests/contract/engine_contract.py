"""The RolloutEngine contract: tests every engine implementation runs.

Subclass ``EngineContract`` in a test module and define ``make_engine(model_dir, seed)``; the
subclass then runs every test below against that engine on the ``tiny_model_dir`` fixture model
(random tiny Llama, character tokenizer: pad 0, eos 1, no BOS). A transformers reference model
loaded from the same folder recomputes logprobs and greedy continuations with plain forwards.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import NamedTuple

import pytest
import torch
from waiting import eventually

from miles_core.engines.base import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams

PROMPTS = ["1+2=", "37+45=", "a", "The sum of 12 and 30 is "]
"""Prompts of different lengths, so batches are left-padded."""


class Counts(NamedTuple):
    """What an engine has seen so far: requests that reached it, requests that sampled a first token."""

    received: int
    first_tokens: int


class EngineContract:
    logprob_atol = 1e-4
    """How close engine logprobs must be to a float32 forward recompute."""
    truncation_renormalises_logprobs = False
    """Capability: with top-k/top-p, the engine's logprobs are over the tokens truncation keeps
    (renormalised there: vLLM's ``processed_logprobs``), not over the whole vocabulary as the
    protocol asks. The logprob test then checks them against that distribution instead, so the
    difference is pinned down, not waved through."""

    def make_engine(self, model_dir: str, seed: int = 0) -> RolloutEngine:
        raise NotImplementedError

    async def counts(self, engine) -> Counts:
        """The engine's ``Counts``: the in-process engine's ``stats``. An engine behind HTTP overrides
        this to read its server's (a request travels to the server first, so a call that has started
        may not have arrived yet)."""
        return Counts(engine.stats.requests_received, engine.stats.first_tokens)

    async def until(self, engine, received: int = 0, first_tokens: int = 0, timeout: float = 30) -> None:
        """Wait until the engine has received ``received`` requests and sampled the first token of
        ``first_tokens`` (counted from its start: add them to a ``counts`` taken before)."""
        async def reached() -> bool:
            now = await self.counts(engine)
            return now.received >= received and now.first_tokens >= first_tokens

        await eventually(reached, timeout, f"{received} requests received, {first_tokens} first tokens")

    async def start_together(self, engine, batches: list[list[GenerateRequest]]) -> list[asyncio.Task]:
        """Start one ``generate`` call per batch, as tasks that all reach the engine before any of
        them runs, so they share a batch: pause, start them, wait until the engine has them, resume."""
        await engine.pause()
        before = await self.counts(engine)
        tasks = [asyncio.create_task(engine.generate(reqs)) for reqs in batches]
        await self.until(engine, received=before.received + sum(map(len, batches)))
        await engine.resume()
        return tasks

    # ------------------------------------------------------------------------------ fixtures

    @pytest.fixture
    def engine(self, tiny_model_dir):
        eng = self.make_engine(str(tiny_model_dir))
        yield eng
        asyncio.run(eng.close())

    @pytest.fixture(scope="class")
    def reference(self, tiny_model_dir):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    @pytest.fixture(scope="class")
    def tok(self, tiny_model_dir):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tiny_model_dir)

    # ------------------------------------------------------------------------------- logprobs

    @pytest.mark.parametrize(
        "params",
        [
            SamplingParams(max_new_tokens=12, temperature=1.0),
            SamplingParams(max_new_tokens=12, temperature=0.7),
            SamplingParams(max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9),
            SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=tuple(range(10, 40))),
        ],
        ids=["t1", "t0.7", "t0.7-topk-topp", "t1-early-stops"],
    )
    def test_logprobs_match_forward_recompute(self, engine, reference, tok, params):
        # the early-stop case ends rows at different steps, so the engine's batch shrinks mid-way
        reqs = requests(tok, params, PROMPTS * 2)
        results = asyncio.run(engine.generate(reqs))
        assert [r.rid for r in results] == [q.rid for q in reqs]
        for r in results:
            assert 0 < len(r.output_ids) == len(r.logprobs) <= params.max_new_tokens
        outputs = [r.output_ids for r in results]
        prompts = [q.prompt_ids for q in reqs]
        if self.truncation_renormalises_logprobs and (params.top_k > 0 or params.top_p < 1):
            expected = recompute_logprobs(reference, prompts, outputs, params.temperature, params.top_k, params.top_p)
        else:
            expected = recompute_logprobs(reference, prompts, outputs, params.temperature)
        for r, exp in zip(results, expected):
            assert torch.allclose(torch.tensor(r.logprobs), exp, atol=self.logprob_atol), (r.logprobs, exp.tolist())
        if params.stop_token_ids:
            stops = set(params.stop_token_ids) | {tok.eos_token_id}
            assert {r.finish_reason for r in results} <= {"stop", "length"}
            assert any(r.finish_reason == "stop" for r in results)
            for r in results:
                assert (r.output_ids[-1] in stops) == (r.finish_reason == "stop")
                assert not stops & set(r.output_ids[:-1])

    def test_greedy_is_argmax_continuation_and_deterministic(self, engine, reference, tok):
        params = SamplingParams(max_new_tokens=8, temperature=0.0)
        reqs = requests(tok, params, PROMPTS)
        first = asyncio.run(engine.generate(reqs))
        second = asyncio.run(engine.generate(reqs))
        assert [r.output_ids for r in first] == [r.output_ids for r in second]
        for q, r in zip(reqs, first):
            assert r.output_ids == greedy_reference(reference, q.prompt_ids, 8, tok.eos_token_id)
        raw = recompute_logprobs(reference, [q.prompt_ids for q in reqs], [r.output_ids for r in first], 1.0)
        for r, exp in zip(first, raw):  # greedy reports the raw logits' log-softmax
            assert torch.allclose(torch.tensor(r.logprobs), exp, atol=self.logprob_atol)

    def test_top_k_1_equals_greedy(self, engine, tok):
        greedy = asyncio.run(engine.generate(requests(tok, SamplingParams(max_new_tokens=8, temperature=0.0))))
        top1 = asyncio.run(engine.generate(requests(tok, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1))))
        assert [r.output_ids for r in top1] == [r.output_ids for r in greedy]

    # --------------------------------------------------------------------------------- stops

    def test_max_new_tokens_ends_with_length(self, engine, tok):
        for n in (1, 5):
            results = asyncio.run(engine.generate(requests(tok, SamplingParams(max_new_tokens=n), PROMPTS * 2)))
            assert any(r.finish_reason == "length" for r in results)
            for r in results:
                if r.finish_reason == "length":
                    assert len(r.output_ids) == n
                else:  # the model may sample EOS first
                    assert r.finish_reason == "stop" and r.output_ids[-1] == tok.eos_token_id

    def test_stop_token_ids_end_the_response(self, engine, tok):
        base = seeded_base(engine, tok)
        stop_id = base.output_ids[4]
        cut = base.output_ids.index(stop_id) + 1
        (r,) = asyncio.run(engine.generate(requests(tok, seeded_params(stop_token_ids=(stop_id,)), PROMPTS[:1])))
        assert r.finish_reason == "stop"
        assert r.output_ids == base.output_ids[:cut]
        assert r.logprobs == pytest.approx(base.logprobs[:cut], abs=self.logprob_atol)

    def test_stop_string_ends_the_response(self, engine, tok):
        base = seeded_base(engine, tok)
        stop = base.text[4:6]
        # the response ends with the token that first completes the stop string
        cut = next(j + 1 for j in range(len(base.output_ids)) if stop in tok.decode(base.output_ids[: j + 1]))
        (r,) = asyncio.run(engine.generate(requests(tok, seeded_params(stop=(stop,)), PROMPTS[:1])))
        assert r.finish_reason == "stop"
        assert r.output_ids == base.output_ids[:cut]
        assert stop in r.text and stop not in tok.decode(r.output_ids[:-1])
        absent = "".join(c for c in "~|^`" if c not in base.text) * 3
        (same,) = asyncio.run(engine.generate(requests(tok, seeded_params(stop=(absent,)), PROMPTS[:1])))
        assert same.output_ids == base.output_ids and same.finish_reason == base.finish_reason

    # --------------------------------------------------------------------------------- seeds

    def test_same_seed_same_output_whatever_the_batch(self, engine, tok):
        params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)
        (alone,) = asyncio.run(engine.generate(requests(tok, params, PROMPTS[1:2])))
        others = requests(tok, SamplingParams(max_new_tokens=10, temperature=1.0, seed=99), PROMPTS)
        mixed = asyncio.run(engine.generate(others[:2] + requests(tok, params, PROMPTS[1:2]) + others[2:]))
        assert mixed[2].output_ids == alone.output_ids
        assert mixed[2].logprobs == pytest.approx(alone.logprobs, abs=self.logprob_atol)
        reseeded = [GenerateRequest(q.prompt_ids, SamplingParams(max_new_tokens=10, seed=8)) for q in others]
        other_seed = asyncio.run(engine.generate(reseeded))
        assert [r.output_ids for r in other_seed] != [r.output_ids for r in mixed[:2] + mixed[3:]]

    def test_unseeded_requests_follow_the_engine_seed(self, tiny_model_dir, tok):
        outputs = []
        for _ in range(2):
            eng = self.make_engine(str(tiny_model_dir), seed=3)
            results = asyncio.run(eng.generate(requests(tok, SamplingParams(max_new_tokens=6))))
            outputs.append([r.output_ids for r in results])
            asyncio.run(eng.close())
        assert outputs[0] == outputs[1]

    def test_mixed_sampling_params_in_one_call(self, engine, tok):
        greedy = requests(tok, greedy_params(max_new_tokens=4), PROMPTS)
        sampled = requests(tok, SamplingParams(max_new_tokens=6, seed=5), PROMPTS)
        for i, q in enumerate(sampled):
            q.rid = f"s{i}"
        mixed = [q for pair in zip(greedy, sampled) for q in pair]
        results = asyncio.run(engine.generate(mixed))
        assert [r.rid for r in results] == [q.rid for q in mixed]
        alone = asyncio.run(engine.generate(greedy))
        assert [r.output_ids for r in results[::2]] == [r.output_ids for r in alone]
        assert all(len(r.output_ids) <= 6 for r in results[1::2])

    # ------------------------------------------------------------------------------- weights

    def test_update_weights_changes_outputs_and_version(self, engine, reference, tok, tmp_path):
        params = seeded_params()
        before = asyncio.run(engine.generate(requests(tok, params)))
        state = perturbed_state(reference)
        path = save_snapshot(state, tmp_path / "model.safetensors", drop_tied=True)
        asyncio.run(engine.update_weights(str(path), 1))
        assert engine.weight_version == 1
        after = asyncio.run(engine.generate(requests(tok, params)))
        assert {r.weight_version for r in after} == {1} and {r.weight_version for r in before} == {0}
        assert [r.output_ids for r in after] != [r.output_ids for r in before]
        updated = _clone_with(reference, state)
        prompts = [q.prompt_ids for q in requests(tok, params)]
        expected = recompute_logprobs(updated, prompts, [r.output_ids for r in after], 1.0)
        for r, exp in zip(after, expected):
            assert torch.allclose(torch.tensor(r.logprobs), exp, atol=self.logprob_atol)
        # a folder URL holding model.safetensors works too; version 2 restores the original weights
        save_snapshot(reference.state_dict(), tmp_path / "v2" / "model.safetensors", drop_tied=False)
        asyncio.run(engine.update_weights((tmp_path / "v2").as_uri(), 2))
        again = asyncio.run(engine.generate(requests(tok, params)))
        assert [r.output_ids for r in again] == [r.output_ids for r in before] and engine.weight_version == 2
        for r, b in zip(again, before):
            assert r.logprobs == pytest.approx(b.logprobs, abs=self.logprob_atol)

    def test_update_weights_with_wrong_keys_raises_naming_the_uri(self, engine, reference, tok, tmp_path):
        before = asyncio.run(engine.generate(requests(tok, seeded_params())))
        state = perturbed_state(reference)
        extra = save_snapshot({**state, "not.a.weight": torch.zeros(2)}, tmp_path / "extra.safetensors", drop_tied=True)
        missing_key = next(k for k in state if "layers.1" in k)
        missing = save_snapshot(
            {k: v for k, v in state.items() if k != missing_key}, tmp_path / "missing.safetensors", drop_tied=True
        )
        for path, key in [(extra, "not.a.weight"), (missing, missing_key)]:
            with pytest.raises(Exception, match=re.escape(str(path))) as err:
                asyncio.run(engine.update_weights(str(path), 5))
            assert key in str(err.value)
        with pytest.raises(Exception, match="nowhere"):
            asyncio.run(engine.update_weights(str(tmp_path / "nowhere.safetensors"), 5))
        assert engine.weight_version == 0
        after = asyncio.run(engine.generate(requests(tok, seeded_params())))
        assert [r.output_ids for r in after] == [r.output_ids for r in before]
        assert [r.logprobs for r in after] == [r.logprobs for r in before]  # nothing was half-loaded

    # --------------------------------------------------------------------------- concurrency

    def test_generate_does_not_block_the_event_loop(self, engine, tok):
        async def body():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.002)
                    ticks += 1

            task = asyncio.create_task(ticker())
            t0 = time.perf_counter()
            await engine.generate(requests(tok, SamplingParams(max_new_tokens=64), PROMPTS * 16))
            elapsed = time.perf_counter() - t0
            task.cancel()
            return ticks, elapsed

        ticks, elapsed = asyncio.run(body())
        assert elapsed > 0.02, "generation too quick to tell"
        assert ticks >= 3, f"only {ticks} ticks in {elapsed:.3f}s of generation"

    def test_pause_holds_new_generation_until_resume(self, engine, tok):
        async def body():
            await engine.pause()
            before = await self.counts(engine)
            task = asyncio.create_task(engine.generate(requests(tok, greedy_params(max_new_tokens=3))))
            await self.until(engine, received=before.received + len(PROMPTS))
            held = not task.done()
            await engine.resume()
            results = await asyncio.wait_for(task, 10)
            return held, results

        held, results = asyncio.run(body())
        assert held
        assert all(r.finish_reason in ("stop", "length") and r.output_ids for r in results)

    def test_abort_stops_in_flight_generation(self, engine, reference, tok):
        # greedy on the random fixture model repeats the prompt's last character: it never ends by itself
        long = SamplingParams(max_new_tokens=2000, temperature=0.0)

        async def body():
            before = await self.counts(engine)
            task = asyncio.create_task(engine.generate(requests(tok, long)))
            await self.until(engine, first_tokens=before.first_tokens + len(PROMPTS))
            await engine.abort()
            aborted = await asyncio.wait_for(task, 10)
            after = await engine.generate(requests(tok, greedy_params(max_new_tokens=3)))
            return aborted, after

        aborted, after = asyncio.run(body())
        assert all(r.finish_reason == "abort" for r in aborted)
        assert all(r.output_ids for r in aborted)
        for q, r in zip(requests(tok, long), aborted):  # the tokens so far come back
            assert len(r.output_ids) == len(r.logprobs) < 2000
            head = r.output_ids[:16]
            assert head == greedy_reference(reference, q.prompt_ids, len(head), tok.eos_token_id)
        assert all(r.finish_reason != "abort" for r in after)

    def test_abort_releases_calls_waiting_at_pause(self, engine, tok):
        async def body():
            await engine.pause()
            before = await self.counts(engine)
            task = asyncio.create_task(engine.generate(requests(tok, greedy_params())))
            await self.until(engine, received=before.received + len(PROMPTS))
            await engine.abort()
            results = await asyncio.wait_for(task, 10)
            await engine.resume()
            return results

        results = asyncio.run(body())
        assert all(r.finish_reason == "abort" and r.output_ids == [] for r in results)

    # ----------------------------------------------------------------- many concurrent calls
    # A fully-async rollout producer sends one call per group or per sample, concurrently, as it
    # would send HTTP requests to a continuous-batching server. The engine may batch them together;
    # each call must still behave as if it ran alone.

    def test_concurrent_calls_give_the_results_of_one_call(self, engine, tok):
        reqs = [
            GenerateRequest(tok.encode(p), SamplingParams(max_new_tokens=6 + 4 * (i % 2), seed=100 + i), rid=f"r{i}")
            for i, p in enumerate(PROMPTS * 3)
        ]
        together = asyncio.run(engine.generate(reqs))

        async def one_call_each():
            return await asyncio.gather(*(engine.generate([q]) for q in reqs))

        separate = [r for (r,) in asyncio.run(one_call_each())]
        assert [r.rid for r in separate] == [q.rid for q in reqs]
        assert [r.output_ids for r in separate] == [r.output_ids for r in together]
        assert [r.finish_reason for r in separate] == [r.finish_reason for r in together]
        for s, t in zip(separate, together):
            assert s.logprobs == pytest.approx(t.logprobs, abs=self.logprob_atol)

    def test_a_short_call_returns_before_the_long_call_it_runs_with(self, engine, reference, tok):
        async def body():
            # the long call comes first: an engine that ran calls one at a time would make the short one wait
            long, short = await self.start_together(engine, [
                requests(tok, greedy_params(max_new_tokens=2000)), requests(tok, greedy_params(max_new_tokens=3))])
            done, _ = await asyncio.wait([long, short], timeout=60, return_when=asyncio.FIRST_COMPLETED)
            long_done_then = long.done()
            await engine.abort()
            return done, long_done_then, short.result(), await asyncio.wait_for(long, 10)

        done, long_done_then, short, long = asyncio.run(body())
        assert not long_done_then and len(done) == 1
        for q, r in zip(requests(tok, greedy_params()), short):
            assert r.finish_reason == "length"
            assert r.output_ids == greedy_reference(reference, q.prompt_ids, 3, tok.eos_token_id)
        assert all(r.finish_reason == "abort" for r in long)

    def test_abort_ends_every_concurrent_call(self, engine, reference, tok):
        long = greedy_params(max_new_tokens=2000)

        async def body():
            before = await self.counts(engine)
            batches = [requests(tok, long, PROMPTS[i : i + 1]) for i in range(3)] + [requests(tok, long, PROMPTS[3:] * 2)]
            tasks = await self.start_together(engine, batches)
            await self.until(engine, first_tokens=before.first_tokens + 5)
            late = asyncio.create_task(engine.generate(requests(tok, long)))  # arrives while the others run
            await self.until(engine, received=before.received + 5 + len(PROMPTS))
            await engine.abort()
            results = await asyncio.wait_for(asyncio.gather(*tasks, late), 10)
            after = await engine.generate(requests(tok, greedy_params(max_new_tokens=3)))
            return results, after

        results, after = asyncio.run(body())
        assert [len(rs) for rs in results] == [1, 1, 1, 2, len(PROMPTS)]
        for rs in results:
            assert all(r.finish_reason == "abort" and len(r.output_ids) == len(r.logprobs) < 2000 for r in rs)
        assert all(r.output_ids for rs in results[:4] for r in rs)
        prompts = PROMPTS[:3] + PROMPTS[3:] * 2
        for p, r in zip(prompts, [r for rs in results[:4] for r in rs]):  # the tokens so far come back
            head = r.output_ids[:16]
            assert head == greedy_reference(reference, tok.encode(p), len(head), tok.eos_token_id)
        assert all(r.finish_reason != "abort" for r in after)

    def test_cancelling_one_call_leaves_the_others_correct(self, engine, tok):
        others = [requests(tok, greedy_params(max_new_tokens=200), PROMPTS[:2]), requests(tok, seeded_params())]

        async def body():
            before = await self.counts(engine)
            cancelled, *tasks = await self.start_together(engine, [requests(tok, greedy_params(max_new_tokens=2000)),
                                                                   *others])
            # mid-request: the greedy rows have tokens (an engine may run the seeded ones after them)
            await self.until(engine, first_tokens=before.first_tokens + len(PROMPTS) + len(others[0]))
            # long enough that it is still queued or running when cancelled, however fast the engine
            late = asyncio.create_task(engine.generate(requests(tok, greedy_params(max_new_tokens=2000))))
            await self.until(engine, received=before.received + len(PROMPTS) * 2 + sum(map(len, others)))
            for task in (cancelled, late):
                task.cancel()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            alone = [await engine.generate(reqs) for reqs in others]
            return [t.cancelled() for t in (cancelled, late)], results, alone

        cancelled, results, alone = asyncio.run(body())
        assert cancelled == [True, True]
        for rs, expected in zip(results, alone):
            assert [r.output_ids for r in rs] == [r.output_ids for r in expected]
            assert [r.finish_reason for r in rs] == [r.finish_reason for r in expected]
            assert all(r.finish_reason != "abort" for r in rs)
            for r, e in zip(rs, expected):
                assert r.logprobs == pytest.approx(e.logprobs, abs=self.logprob_atol)

    def test_health_and_initial_version(self, engine):
        assert isinstance(engine, RolloutEngine)
        assert asyncio.run(engine.health()) is True
        assert engine.weight_version == 0


class UnseenProgress:
    """Mix in before ``EngineContract`` for a server whose progress a test cannot read (a real SGLang
    server serves its metrics only with ``--enable-metrics``): ``until`` then waits ``progress_s``,
    long enough for calls to reach the server and for running requests to sample a token. vLLM's
    ``/metrics`` count first tokens and requests in or through its scheduler, but not the requests
    a paused vLLM holds (``tests/integration/test_engine_vllm.py``)."""

    progress_s = 0.2

    async def until(self, engine, received: int = 0, first_tokens: int = 0, timeout: float = 30) -> None:
        await asyncio.sleep(self.progress_s)

    async def counts(self, engine) -> Counts:
        return Counts(0, 0)


# ---------------------------------------------------------------------------------- helpers


def build_server_model(folder) -> str:
    """The contract's kind of model (random tiny Llama, character tokenizer) in a shape real servers
    take: head size 32 (vLLM's CPU attention has no kernel for 16), and room for 2,000-token
    responses (vLLM refuses a request longer than ``max_position_embeddings``; RoPE itself has no
    limit, and the reference forward reads the same folder)."""
    import json
    from pathlib import Path

    from miles_core.config import TinyModelRecipe
    from miles_core.models.tiny import build_untrained

    torch.set_num_threads(1)
    build_untrained(TinyModelRecipe(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128), folder)
    config = json.loads((Path(folder) / "config.json").read_text())
    (Path(folder) / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return str(folder)


def requests(tok, params: SamplingParams, prompts: list[str] = PROMPTS) -> list[GenerateRequest]:
    return [GenerateRequest(tok.encode(p), params, rid=f"r{i}") for i, p in enumerate(prompts)]


def greedy_params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 10, "temperature": 0.0, **kw})


def seeded_params(**kw) -> SamplingParams:
    """Seeded sampling: varied tokens (greedy on a random tied-embedding model mostly repeats the
    prompt's last character), yet the same tokens on every call."""
    return SamplingParams(**{"max_new_tokens": 10, "temperature": 1.0, "seed": 11, **kw})


def seeded_base(engine, tok) -> GenerateResult:
    """Seeded response to the first prompt; the stop tests need one of at least 7 tokens."""
    (r,) = asyncio.run(engine.generate(requests(tok, seeded_params(), PROMPTS[:1])))
    assert len(r.output_ids) >= 7 and tok.eos_token_id not in r.output_ids, "fixture model changed: pick another seed"
    return r


@torch.no_grad()
def recompute_logprobs(
    model, prompts: list[list[int]], outputs: list[list[int]], temperature: float, top_k: int = -1,
    top_p: float = 1.0,
) -> list[torch.Tensor]:
    """log_softmax(logits / T) of each output token, from one left-padded forward (T=0 means 1);
    with ``top_k`` / ``top_p``, over the tokens they keep (top-k first, then the smallest set of
    the most likely tokens whose probability reaches ``top_p``), renormalised there."""
    seqs = [p + o for p, o in zip(prompts, outputs)]
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, width - len(s) :] = torch.tensor(s)
        mask[b, width - len(s) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    logits = logits / (temperature or 1.0)
    if top_k > 0 or top_p < 1:
        logits = _truncated(logits, top_k, top_p)
    logprobs = torch.log_softmax(logits, -1)
    result = []
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        start = width - len(o)  # the first output token sits here; it is predicted one position earlier
        lp = logprobs[b, start - 1 : width - 1].gather(-1, torch.tensor(o)[:, None]).squeeze(-1)
        result.append(lp)
    return result


def _truncated(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` with the tokens top-k and then top-p drop set to -inf."""
    if top_k > 0:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ordered, order = logits.sort(-1, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int, eos: int) -> list[int]:
    """Argmax continuation by full forwards without a cache."""
    seq = list(prompt)
    for _ in range(n):
        nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(nxt)
        if nxt == eos:
            break
    return seq[len(prompt) :]


def perturbed_state(model, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The model's weights plus noise; tied names (one tensor) get the same noisy tensor."""
    g = torch.Generator().manual_seed(1234)
    noisy: dict[int, torch.Tensor] = {}
    state = {}
    for k, v in model.state_dict().items():
        if v.data_ptr() not in noisy:
            noisy[v.data_ptr()] = v + scale * v.std().nan_to_num(0) * torch.randn(v.shape, generator=g)
        state[k] = noisy[v.data_ptr()]
    return state


def save_snapshot(state: dict[str, torch.Tensor], path, drop_tied: bool):
    """Write a safetensors file (safetensors refuses shared tensors, so everything is cloned)."""
    from safetensors.torch import save_file

    state = {k: v.detach().clone().contiguous() for k, v in state.items() if not (drop_tied and k == "lm_head.weight")}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def _clone_with(model, state: dict[str, torch.Tensor]):
    import copy

    clone = copy.deepcopy(model)
    clone.load_state_dict(state)
    return clone
