"""SGLangEngine over real HTTP against the CPU stand-in server (``LocalEngineServer`` over an
``HFEngine`` in its own process): the engine contract, plus what is particular to the server and
to the engine ``setup_engine`` launches.

The contract tests share one server (a start costs ~3 s of imports and model loading); each test
gets a fresh client, and the server is put back as it was afterwards (aborted, resumed, version 0
with the original weights). The test that needs fresh engine seeds starts its own servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest
from contract.engine_contract import PROMPTS, Counts, EngineContract, greedy_params, requests

from waiting import eventually

from miles_core.config import SGLangEngineConfig
from miles_core.engines import setup_engine
from miles_core.engines.base import GenerateRequest, SamplingParams
from miles_core.engines.server import LocalEngineServer
from miles_core.engines.sglang import EngineHTTPError, SGLangEngine

pytestmark = pytest.mark.integration

SERVER_CFG = SGLangEngineConfig(max_batch_size=64, num_threads=1, coalesce_window_s=0)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with LocalEngineServer(str(tiny_model_dir), SERVER_CFG) as server:
        yield server


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def client(server, coalesce_window_s: float = 0.0) -> SGLangEngine:
    """A client where each call is its own HTTP request (the contract's per-call semantics) unless
    ``coalesce_window_s`` is set."""
    cfg = SGLangEngineConfig(url=server.url, request_timeout_s=60, coalesce_window_s=coalesce_window_s)
    return SGLangEngine(server.url, cfg)


async def restore(server, model_dir) -> None:
    """Put the shared server back as a fresh one: nothing running or paused, original weights, v0."""
    eng = client(server)
    await eng.abort()
    await eng.resume()
    version = httpx.get(f"{server.url}/get_weight_version", timeout=10).json()["weight_version"]
    if version != "0":
        await eng.update_weights(os.path.join(model_dir, "model.safetensors"), 0)
    await eng.close()


async def server_counts(url: str) -> Counts:
    """The stand-in server's ``/stats`` as the contract's ``Counts``."""
    async with httpx.AsyncClient() as http:
        stats = (await http.get(f"{url}/stats", timeout=10)).json()
    return Counts(stats["requests_received"], stats["first_tokens"])


class TestSGLangEngineContract(EngineContract):
    async def counts(self, engine) -> Counts:
        return await server_counts(engine.url)

    @pytest.fixture
    def engine(self, server, tiny_model_dir):
        eng = client(server)
        yield eng
        asyncio.run(eng.close())
        asyncio.run(restore(server, str(tiny_model_dir)))

    def make_engine(self, model_dir: str, seed: int = 0):
        """A fresh server (the seed of unseeded requests is the server's), owned by the engine."""
        server = LocalEngineServer(model_dir, SERVER_CFG, seed=seed).start()
        return SGLangEngine(server.url, SERVER_CFG, server=server)


# ------------------------------------------------------------------------------ the server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_generate_json_shapes_single_and_batch(server, tok):
    single = post(server, "/generate", {"input_ids": tok.encode("1+2="), "return_logprob": True,
                                        "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert single.status_code == 200
    out = single.json()  # a single prompt answers one object, not a list
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3} and meta["weight_version"] == "0"
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 3
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert out["text"] == tok.decode(out["output_ids"])
    batch = post(server, "/generate", {"input_ids": [tok.encode("a"), tok.encode("bc")], "rid": "q",
                                       "sampling_params": {"max_new_tokens": 2}}).json()
    assert [b["meta_info"]["id"] for b in batch] == ["q_0", "q_1"]  # one rid string is a prefix
    assert all("output_token_logprobs" not in b["meta_info"] for b in batch)  # not asked for


def test_stop_matches_and_sglang_trims_them_unless_asked_not_to(server, tok):
    base = {"input_ids": tok.encode(PROMPTS[0]), "sampling_params": {"max_new_tokens": 10, "sampling_seed": 11}}
    full = post(server, "/generate", base).json()
    stop_id = full["output_ids"][2]
    cut = full["output_ids"].index(stop_id) + 1
    stop_params = {**base["sampling_params"], "stop_token_ids": [stop_id]}
    by_token = post(server, "/generate", {**base, "sampling_params": stop_params}).json()
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert by_token["output_ids"] == full["output_ids"][:cut]
    assert by_token["text"] == tok.decode(full["output_ids"][: cut - 1])  # the stop token is trimmed from the text
    stop = full["text"][3:5]
    for no_trim in (False, True):
        params = {**base["sampling_params"], "stop": [stop], "no_stop_trim": no_trim}
        r = post(server, "/generate", {**base, "sampling_params": params}).json()
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert r["text"].endswith(stop) == no_trim and stop not in r["text"][:-len(stop)]


@pytest.mark.parametrize("body, message", [
    ({"text": "1+2="}, "text='1+2=' is not supported"),
    ({"input_ids": [5], "stream": True}, "stream=True is not supported"),
    ({"input_ids": [5], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty=0.5 is not supported"),
    ({"input_ids": [5], "sampling_params": {"max_tokens": 5}}, "unsupported sampling params: max_tokens"),
    ({"input_ids": [5], "return_logprob": True, "logprob_start_len": 2}, "prompt logprobs are from the first token only"),
    ({"input_ids": [5], "sampling_params": {"top_p": 0}}, "top_p=0.0 must be in"),  # the engine's own check
    ({"input_ids": [5], "lora_path": "math"}, "adapter 'math'"),
])
def test_the_server_refuses_what_it_does_not_do_with_400(server, body, message):
    r = post(server, "/generate", body)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_client_errors_name_the_url_and_status(server):
    eng = client(server)
    with pytest.raises(EngineHTTPError, match=rf"{server.url}/generate answered HTTP 400: .*top_k=0"):
        asyncio.run(eng.generate([GenerateRequest([5], SamplingParams(top_k=0))]))
    with pytest.raises(EngineHTTPError, match=r"load_lora_adapter answered HTTP 400: .*adapter folder not found"):
        asyncio.run(eng.load_adapter("math", "/nowhere"))
    asyncio.run(eng.close())


def test_a_disconnected_client_leaves_the_running_batch(server, tok):
    # the call would run for minutes; the short one after it is dispatched only once the batch ends
    async def body():
        eng = client(server)
        before = await server_counts(server.url)
        long = asyncio.create_task(eng.generate(requests(tok, greedy_params(max_new_tokens=10**5))))

        async def decoding():
            return (await server_counts(server.url)).first_tokens >= before.first_tokens + len(PROMPTS)

        await eventually(decoding, what="the long call decodes")
        long.cancel()
        t0 = time.monotonic()
        short = await eng.generate(requests(tok, greedy_params(max_new_tokens=3)))
        await eng.close()
        return long.cancelled(), time.monotonic() - t0, short

    cancelled, seconds, short = asyncio.run(body())
    assert cancelled and seconds < 10
    assert all(r.finish_reason == "length" for r in short)


def test_calls_within_the_coalescing_window_share_one_request(server, tok):
    async def body():
        eng = client(server, coalesce_window_s=0.05)
        seen = []
        transport = eng._transport
        real = transport.request

        async def counting(method, url, payload, timeout):
            if url.endswith("/generate"):
                seen.append(len(payload["input_ids"]))
            return await real(method, url, payload, timeout)

        transport.request = counting
        calls = [eng.generate(requests(tok, greedy_params(max_new_tokens=3))[:1]) for _ in range(5)]
        together = await asyncio.gather(*calls)
        alone = await client(server).generate(requests(tok, greedy_params(max_new_tokens=3))[:1])
        await eng.close()
        return seen, together, alone

    seen, together, alone = asyncio.run(body())
    assert seen == [5], "five calls in one window travel as one batch of five"
    assert all(len(r) == 1 and r[0].output_ids == alone[0].output_ids for r in together)


# --------------------------------------------------------------- the engine setup_engine launches


def test_setup_engine_launches_a_pinned_server_and_close_stops_it(tiny_model_dir, tok):
    core = max(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    cfg = SGLangEngineConfig(cpu_affinity=[core], max_batch_size=8)
    engine = setup_engine(cfg, str(tiny_model_dir), "float32", seed=0)
    proc = engine.server.proc
    try:
        assert os.sched_getaffinity(proc.pid) == {core} and os.sched_getaffinity(0) == mine
        results = asyncio.run(engine.generate(requests(tok, greedy_params(max_new_tokens=4))))
        assert all(len(r.output_ids) == 4 for r in results)
        assert asyncio.run(engine.health()) is True
    finally:
        asyncio.run(engine.close())
    assert proc.poll() is not None  # the server process has ended
    assert asyncio.run(engine.health()) is False


def test_a_server_that_cannot_start_says_why(tmp_path):
    cfg = SGLangEngineConfig(startup_timeout_s=60)
    with pytest.raises(RuntimeError, match=r"exited with code 1; its last output:(.|\n)*" + str(tmp_path / "empty")):
        LocalEngineServer(str(tmp_path / "empty"), cfg).start()


def test_storage_options_reach_the_server_through_its_environment(tiny_model_dir):
    server = LocalEngineServer(str(tiny_model_dir), SERVER_CFG, storage_options={"key": "secret"})
    assert "secret" not in json.dumps(server.command())  # never on the command line


def test_adapters_load_and_serve_over_http(server, tok, tiny_model_dir, tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)  # LoRA weights drawn at random (init_lora_weights=False), so the adapter changes the policy
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(tmp_path / "math")

    async def body():
        eng = client(server)
        await eng.load_adapter("math", str(tmp_path / "math"), version=5)
        base = await eng.generate(requests(tok, greedy_params(max_new_tokens=4)))
        reqs = [GenerateRequest(r.prompt_ids, r.sampling, rid=r.rid, adapter="math")
                for r in requests(tok, greedy_params(max_new_tokens=4))]
        adapted = await eng.generate(reqs)
        await eng.close()
        return base, adapted

    base, adapted = asyncio.run(body())
    assert [r.logprobs for r in base] != [r.logprobs for r in adapted], "lora_path selects the adapter"
    assert {r.weight_version for r in adapted} == {5} and {r.weight_version for r in base} == {0}


def test_prompt_logprobs_under_an_adapter_and_unloading_it(server, tok, tiny_model_dir, tmp_path):
    """``prompt_logprobs`` (``logprob_start_len`` 0: the Tinker service's ``compute_logprobs``) is
    PEFT's forward under the adapter; an unloaded adapter serves no more requests."""
    import math

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(6)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    peft.save_pretrained(tmp_path / "u")
    ids = tok.encode(PROMPTS[0])

    async def body():
        eng = client(server)
        await eng.load_adapter("keep", str(tmp_path / "u"))  # PEFT keeps one adapter: "u" is not the last
        await eng.load_adapter("u", str(tmp_path / "u"), version=2)
        got, base = await eng.prompt_logprobs(ids, "u"), await eng.prompt_logprobs(ids)
        assert await eng.unload_adapter("u") is True
        with pytest.raises(EngineHTTPError, match="adapter 'u'"):
            await eng.generate([GenerateRequest(ids, greedy_params(max_new_tokens=2), adapter="u")])
        assert await eng.unload_adapter("u") is False
        await eng.close()
        return got, base

    got, base = asyncio.run(body())
    with torch.no_grad():
        logits = peft.eval()(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(got) == len(ids) and math.isnan(got[0])
    assert torch.allclose(torch.tensor(got[1:]), want, atol=1e-5), (got, want.tolist())
    assert not torch.allclose(torch.tensor(base[1:]), want, atol=1e-3)
