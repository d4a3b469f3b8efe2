"""VLLMEngine's mapping against a fake transport (the requests it sends, the replies it reads,
the order of a weight update) and its snapshot checks; no server. The contract over a real vLLM
server is in tests/integration/test_engine_vllm.py."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles_core.config import RunConfig, VLLMEngineConfig
from miles_core.engines.base import GenerateRequest, SamplingParams
from miles_core.engines.http import EngineHTTPError
from miles_core.engines.vllm import VLLMEngine, check_snapshot, local_path

URL = "http://vllm.test:8000"


class FakeTransport:
    def __init__(self, handler) -> None:
        self.handler, self.seen = handler, []

    async def request(self, method, url, body, timeout):
        self.seen.append((method, url.removeprefix(URL), body))
        status, reply = self.handler(method, url.removeprefix(URL), body)
        return status, json.dumps(reply).encode()

    async def close(self):
        pass


def completion(ids, logprobs, finish="stop", text="ab"):
    return {"choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish,
                         "logprobs": {"token_logprobs": logprobs, "tokens": [f"token_id:{i}" for i in ids]}}]}


def engine(handler, **kw):
    transport = FakeTransport(handler)
    return VLLMEngine(URL, VLLMEngineConfig(url=URL), transport=transport, **kw), transport.seen


def run(eng, coro):
    try:
        return asyncio.run(coro)
    finally:
        asyncio.run(eng.close())


def test_a_request_is_one_completion_with_every_sampling_field_and_token_ids_both_ways():
    def handler(method, path, body):
        if path == "/v1/models":
            return 200, {"data": [{"id": "lora-x", "parent": "m"}, {"id": "m", "parent": None}]}
        return 200, completion([7, 8, 1], [-0.5, -0.25, -0.125])

    eng, seen = engine(handler)
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=4, stop=("\n",), stop_token_ids=(9,), seed=3)
    (r,) = run(eng, eng.generate([GenerateRequest([1, 2, 3], params, rid="q1")]))
    assert (r.output_ids, r.logprobs, r.finish_reason, r.rid, r.weight_version) == ([7, 8, 1], [-0.5, -0.25, -0.125], "stop", "q1", 0)
    body = seen[-1][2]
    assert seen[0][:2] == ("GET", "/v1/models") and seen[-1][:2] == ("POST", "/v1/completions")
    assert body["model"] == "m" and body["prompt"] == [1, 2, 3]  # the base model: the entry without a parent
    assert {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed")} == \
        {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 4, "stop": ["\n"], "stop_token_ids": [9], "seed": 3}
    assert body["logprobs"] == 0 and body["return_token_ids"] and body["include_stop_str_in_output"]
    assert body["request_id"].startswith("q1-")


def test_finish_reasons_and_replies_that_do_not_fit_name_the_url():
    replies = iter([completion([4], [-1.0], "length"), completion([4], [-1.0], "repetition"),
                    completion([4, 5], [-1.0], "stop"), completion([4], [-1.0], "error")])
    eng, _ = engine(lambda *a: (200, next(replies)), model="m")

    async def calls():
        out = []
        for _ in range(4):
            try:
                out.append((await eng.generate([GenerateRequest([1])]))[0].finish_reason)
            except EngineHTTPError as e:
                out.append(str(e))
        return out

    length, repetition, short, error = run(eng, calls())
    assert (length, repetition) == ("length", "stop")  # vLLM's repetition stop reads as a stop
    assert "/v1/completions answered HTTP 200" in short and "2 token ids but 1 logprobs" in short
    assert "finish_reason 'error'" in error


def test_a_weight_update_pauses_reloads_the_folder_resets_the_cache_and_resumes(tmp_path):
    eng, seen = engine(lambda *a: (200, {}), model="m")
    folder = tmp_path / "v3"
    folder.mkdir()
    run(eng, eng.update_weights(folder.as_uri(), 3))
    assert [(m, p) for m, p, _ in seen] == [("POST", "/pause?mode=keep"), ("POST", "/collective_rpc"),
                                           ("POST", "/reset_prefix_cache"), ("POST", "/update_weight_version"),
                                           ("POST", "/resume")]
    assert seen[1][2] == {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
    assert seen[3][2] == {"new_version": "3"} and eng.weight_version == 3


def test_a_failed_reload_keeps_the_version_and_resumes():
    def handler(method, path, body):
        return (500, {"error": {"message": "reload broke"}}) if path == "/collective_rpc" else (200, {})

    eng, seen = engine(handler, model="m")
    with pytest.raises(EngineHTTPError, match="collective_rpc answered HTTP 500: reload broke"):
        run(eng, eng.update_weights("/w/v4", 4))
    assert eng.weight_version == 0 and seen[-1][1] == "/resume"


def test_adapters_load_by_name_in_place_after_the_first_and_stamp_their_version():
    eng, seen = engine(lambda m, p, b: (200, completion([2], [-0.1]) if p == "/v1/completions" else {}), model="m")

    async def body():
        await eng.load_adapter("a", "/w/a-v1", 1)
        await eng.load_adapter("a", "/w/a-v2", 2)
        return await eng.generate([GenerateRequest([1], adapter="a")])

    (r,) = run(eng, body())
    loads = [b for _, p, b in seen if p == "/v1/load_lora_adapter"]
    assert loads == [{"lora_name": "a", "lora_path": "/w/a-v1", "load_inplace": False},
                     {"lora_name": "a", "lora_path": "/w/a-v2", "load_inplace": True}]
    assert seen[-1][2]["model"] == "a" and r.weight_version == 2


def test_snapshots_are_checked_against_the_served_model(tmp_path):
    served = tmp_path / "model"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    state = {"model.embed_tokens.weight": torch.ones(4, 2), "model.norm.weight": torch.ones(2)}
    save_file(state, str(served / "model.safetensors"))
    good = tmp_path / "good.safetensors"
    save_file({k: v * 2 for k, v in state.items()}, str(good))
    assert set(check_snapshot("good", str(good), str(served))) == set(state)
    bad = tmp_path / "bad.safetensors"
    save_file({"model.embed_tokens.weight": torch.ones(4, 3), "extra.w": torch.ones(1)}, str(bad))
    with pytest.raises(ValueError, match=r"weights s3-ish do not fit .*not weights of the served model: extra.w; "
                                         r"missing: model.norm.weight; other shapes: model.embed_tokens.weight"):
        check_snapshot("s3-ish", str(bad), str(served))
    # a tied model's snapshot without lm_head.weight is staged with it (vLLM's reload would keep the old head)
    staged = {}

    def reload(method, path, body):
        if path == "/collective_rpc":  # what vLLM would read, during the call
            folder = body["kwargs"]["weights_path"]
            staged.update(folder=folder, head=load_file(f"{folder}/lm_head.safetensors")["lm_head.weight"],
                          names=load_file(f"{folder}/model.safetensors").keys())
        return 200, {}

    eng, seen = engine(reload, model="m", model_dir=str(served), server=Server())  # a server on this machine
    run(eng, eng.update_weights(str(good), 1))
    assert torch.equal(staged["head"], state["model.embed_tokens.weight"] * 2)
    assert staged["names"] == state.keys()
    assert not os.path.exists(staged["folder"])  # vLLM reads it during the call only: removed after
    far, _ = engine(reload, model="m", model_dir=str(served))  # on another machine: no staging there
    with pytest.raises(ValueError, match="on another machine reloads a snapshot folder as it is"):
        run(far, far.update_weights(str(good), 1))


def test_weights_must_be_on_the_servers_disk():
    assert local_path("file:///w/v1") == "/w/v1" and local_path("/w/v1") == "/w/v1"
    with pytest.raises(ValueError, match="s3://b/w/v1: a vLLM server loads weights from a folder on its own disk"):
        local_path("s3://b/w/v1")


def test_the_vllm_engine_is_a_config_choice():
    server = {"engine": {"type": "vllm", "url": "http://10.0.0.5:8000"}}
    cfg = RunConfig.model_validate({**server, "eval": {"engine": "shared"}})
    assert isinstance(cfg.engine, VLLMEngineConfig) and cfg.engine.url == "http://10.0.0.5:8000"
    with pytest.raises(ValueError, match="needs an evaluation engine of its own"):  # as for an SGLang server
        RunConfig.model_validate(server)
    with pytest.raises(ValueError, match="must start with http"):
        VLLMEngineConfig(url="10.0.0.5:8000")


def test_weights_on_remote_storage_are_copied_for_a_server_on_this_machine():
    """A snapshot and an adapter on object storage (``memory://`` here, ``s3://`` in a run): a server
    at a loopback URL (or launched) reloads from a local copy, removed once the reload returns; an
    adapter's copy stays while that version is loaded (vLLM reloads an evicted adapter from its
    path) and goes when the next version replaces it."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for version in (1, 2):
        with fs.open(f"/run/weights/v{version}/model.safetensors", "wb") as f:
            f.write(f"weights {version}".encode())
    for version in (1, 2):
        fs.pipe_file(f"/run/adapters/a/v{version}/adapter_config.json", f'{{"v": {version}}}'.encode())
    reloads, adapters = [], []

    class Local(FakeTransport):
        async def request(self, method, url, body, timeout):
            path = url.split(":8000", 1)[1]
            if path == "/collective_rpc":
                folder = body["kwargs"]["weights_path"]
                reloads.append((folder, Path(folder, "model.safetensors").read_bytes()))
            if path == "/v1/load_lora_adapter":
                adapters.append(body["lora_path"])
            return 200, b"{}"

    eng = VLLMEngine("http://127.0.0.1:8000", VLLMEngineConfig(url="http://127.0.0.1:8000"), transport=Local(None),
                     model="m")

    async def body():
        await eng.update_weights("memory://run/weights/v1", 1)
        await eng.update_weights("memory://run/weights/v2", 2)
        await eng.load_adapter("a", "memory://run/adapters/a/v1", 1)
        first = Path(adapters[0], "adapter_config.json").read_text()
        await eng.load_adapter("a", "memory://run/adapters/a/v2", 2)
        return first, Path(adapters[0]).exists(), Path(adapters[1], "adapter_config.json").read_text()

    first, first_kept, second = run(eng, body())
    assert [data for _, data in reloads] == [b"weights 1", b"weights 2"]
    assert not any(Path(folder).exists() for folder, _ in reloads)
    assert (first, first_kept, second) == ('{"v": 1}', False, '{"v": 2}')
    assert Path(adapters[1]).exists()  # a server of our own may still serve it after we close
    shutil.rmtree(adapters[1])
    far = VLLMEngine("http://10.0.0.5:8000", VLLMEngineConfig(url="http://10.0.0.5:8000"), transport=Local(None), model="m")
    with pytest.raises(ValueError, match="a vLLM server loads weights from a folder on its own disk"):
        run(far, far.update_weights("memory://run/weights/v1", 1))


def test_unseeded_requests_get_seeds_from_the_engine_seed_in_submission_order():
    def seeds_sent(seed):
        eng, seen = engine(lambda *a: (200, completion([1], [-0.1])), model="m", seed=seed)
        run(eng, eng.generate([GenerateRequest([1]), GenerateRequest([2], SamplingParams(seed=5)), GenerateRequest([3])]))
        return [body.get("seed") for _, path, body in seen if path == "/v1/completions"]

    first, again, other = seeds_sent(3), seeds_sent(3), seeds_sent(4)
    assert first == again and first[1] == 5 and first[0] != first[2] and first != other
    assert seeds_sent(None)[0] is None  # no engine seed: vLLM's own generator


class Server:
    """Stands in for a launched ``LocalVLLMServer`` (what ``close()`` stops)."""

    model_dir = None

    def stop(self):
        self.stopped = True


def test_copies_stay_while_the_server_may_read_them():
    """A reload that got no answer (a timeout) may still be reading its copy on the server: it is
    kept until a reload succeeds; a refused one (HTTP 500) is removed at once. Adapter copies of a
    launched server go when it stops."""
    import fsspec

    from miles_core.engines.http import EngineUnreachable

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/copies/w/v1/model.safetensors", b"w")
    fs.pipe_file("/copies/a/v1/adapter_config.json", b"{}")
    answers, reloads, adapters = iter(["silent", "refused", "ok"]), [], []

    class Local(FakeTransport):
        async def request(self, method, url, body, timeout):
            path = url.split(":8000", 1)[1]
            if path == "/v1/load_lora_adapter":
                adapters.append(body["lora_path"])
            if path == "/collective_rpc":
                reloads.append(body["kwargs"]["weights_path"])
                answer = next(answers)
                if answer == "silent":
                    raise EngineUnreachable(f"{url}: no answer within {timeout:g} s")
                if answer == "refused":
                    return 500, b'{"error": {"message": "no"}}'
            return 200, b"{}"

    url = "http://127.0.0.1:8000"
    eng = VLLMEngine(url, VLLMEngineConfig(url=url), server=Server(), transport=Local(None), model="m")

    async def body():
        kept = []
        for expected in (EngineUnreachable, EngineHTTPError, None):
            try:
                await eng.update_weights("memory://copies/w/v1", 1)
            except Exception as e:  # noqa: BLE001 (the test checks which)
                assert isinstance(e, expected)
            kept.append([Path(r).exists() for r in reloads])
        await eng.load_adapter("a", "memory://copies/a/v1", 1)
        return kept, Path(adapters[0]).exists()

    kept, adapter_kept = run(eng, body())
    assert kept == [[True], [True, False], [False, False, False]]  # the unanswered copy goes once one succeeds
    assert adapter_kept and not Path(adapters[0]).exists()  # gone once the launched server stopped


def test_idle_connections_close_before_vllm_closes_them():
    """vLLM's API server closes a connection idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (read from the
    vLLM that scripts/setup-vllm.sh installs); the client must give up on it first."""
    from miles_core.engines.http import IDLE_CONNECTION_S

    lib = Path(__file__).resolve().parents[2] / ".cache" / "vllm-env" / "lib"
    envs = sorted(lib.glob("python3*/site-packages/vllm/envs.py"))
    if not envs:
        if os.environ.get("CI"):
            pytest.fail("vLLM's environment is missing: scripts/test.sh builds it")
        pytest.skip("vLLM's environment is not built (scripts/setup-vllm.sh)")
    text = envs[0].read_text()
    default = text.split('os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "', 1)[1].split('"', 1)[0]
    assert IDLE_CONNECTION_S < float(default) - 1, (IDLE_CONNECTION_S, default)


def test_prompt_logprobs_and_unloading_an_adapter():
    """``prompt_logprobs``: a one-token completion with ``prompt_logprobs=0`` under the adapter, read
    as vLLM returns it (None, then the prompt token's id -> its logprob); ``unload_adapter``:
    ``/v1/unload_lora_adapter``, once."""
    def handler(method, path, body):
        if path == "/v1/completions" and body.get("prompt_logprobs") == 0:
            entries = [None] + [{str(t): {"logprob": -0.5 * t, "rank": 1, "decoded_token": "x"}} for t in body["prompt"][1:]]
            return 200, {**completion([2], [-0.1]), "choices": [{**completion([2], [-0.1])["choices"][0],
                                                                 "prompt_logprobs": entries}]}
        return 200, {}

    eng, seen = engine(handler, model="m")

    async def body():
        await eng.load_adapter("a", "/w/a", 1)
        lp = await eng.prompt_logprobs([3, 4, 6], "a")
        return lp, await eng.unload_adapter("a"), await eng.unload_adapter("a")

    lp, first, again = run(eng, body())
    assert lp[1:] == [-2.0, -3.0] and lp[0] != lp[0]  # NaN for the first token
    (ask,) = [b for _, p, b in seen if p == "/v1/completions"]
    assert (ask["model"], ask["prompt"], ask["max_tokens"], ask["temperature"]) == ("a", [3, 4, 6], 1, 1.0)
    assert (first, again) == (True, False)
    assert [b for _, p, b in seen if p == "/v1/unload_lora_adapter"] == [{"lora_name": "a"}]


def test_prompt_logprobs_that_do_not_fit_the_prompt_name_the_url():
    reply = {"choices": [{"prompt_logprobs": [None, {"9": {"logprob": -1.0}}]}]}
    eng, _ = engine(lambda *a: (200, reply), model="m")
    with pytest.raises(EngineHTTPError, match=r"/v1/completions answered HTTP 200: .*3 prompt tokens"):
        run(eng, eng.prompt_logprobs([1, 2, 3]))
    eng, _ = engine(lambda *a: (200, reply), model="m")
    with pytest.raises(EngineHTTPError, match=r"unexpected prompt logprobs: KeyError\('2'\)"):
        run(eng, eng.prompt_logprobs([1, 2]))
