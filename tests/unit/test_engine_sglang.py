"""SGLangEngine's JSON mapping against a fake transport: the request it sends, and replies the CPU
stand-in server never gives (HTTP 500, SGLang's abort shape); no server at all. The contract over
real HTTP is in tests/integration/test_engine_sglang_http.py."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.config import RunConfig, SGLangEngineConfig
from miles_core.engines.base import GenerateRequest, SamplingParams
from miles_core.engines.http import EngineTimeout
from miles_core.engines.sglang import EngineHTTPError, EngineUnreachable, SGLangEngine, parse_weight_version

URL = "http://engine.test:30000"


class FakeTransport:
    """Answers each request with ``handler(method, url, body) -> (status, JSON value or bytes)``."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.seen: list[tuple[str, str, dict | None]] = []

    async def request(self, method, url, body, timeout):
        self.seen.append((method, url, body))
        status, reply = self.handler(method, url, body)
        return status, reply if isinstance(reply, bytes) else json.dumps(reply).encode()

    async def close(self):
        pass


_made: list[SGLangEngine] = []


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    while _made:
        asyncio.run(_made.pop().close())


def fake_engine(handler) -> tuple[SGLangEngine, list[tuple[str, str, dict | None]]]:
    """An engine whose requests go to ``handler``; also the requests it sent (method, URL, body)."""
    transport = FakeTransport(handler)
    _made.append(SGLangEngine(URL + "/", SGLangEngineConfig(url=URL), transport=transport))
    return _made[-1], transport.seen


def replying(status, reply):
    return lambda method, url, body: (status, reply)


def item(ids, logprobs, finish, version="3", text="xy"):
    return {"text": text, "output_ids": ids, "meta_info": {
        "id": "wire", "finish_reason": finish, "weight_version": version,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}}


def test_generate_sends_one_batch_request_and_maps_the_results():
    reply = [item([5, 6], [-0.5, -1.5], {"type": "stop", "matched": 6}),
             item([7], [-0.25], {"type": "length", "length": 1}, version="default")]
    engine, seen = fake_engine(replying(200, reply))
    params = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5, stop=("\n",), stop_token_ids=(6,),
                            seed=42)
    reqs = [GenerateRequest([1, 2], params, rid="a"), GenerateRequest([3], SamplingParams(max_new_tokens=1), rid="a")]
    results = asyncio.run(engine.generate(reqs))

    ((method, url, body),) = seen
    assert (method, url) == ("POST", URL + "/generate")
    assert body["input_ids"] == [[1, 2], [3]]
    assert body["sampling_params"][0] == {
        "max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "stop": ["\n"], "stop_token_ids": [6],
        "sampling_seed": 42, "no_stop_trim": True, "skip_special_tokens": True}
    assert "sampling_seed" not in body["sampling_params"][1] and "stop" not in body["sampling_params"][1]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and body["stream"] is False
    assert "lora_path" not in body  # no adapter asked for
    # the caller's rids repeat; the wire rids are unique (SGLang refuses duplicate in-flight ids)
    assert len(set(body["rid"])) == 2 and all(r.startswith("a-") for r in body["rid"])

    assert [r.rid for r in results] == ["a", "a"]
    assert [r.output_ids for r in results] == [[5, 6], [7]]
    assert [r.logprobs for r in results] == [[-0.5, -1.5], [-0.25]]
    assert [r.finish_reason for r in results] == ["stop", "length"]
    assert [r.weight_version for r in results] == [3, 0]  # "default": the server's own weights


def test_adapters_travel_as_lora_path_per_request():
    engine, seen = fake_engine(replying(200, [item([1], [-1.0], {"type": "length"})] * 2))
    asyncio.run(engine.generate([GenerateRequest([1], adapter="math"), GenerateRequest([2])]))
    assert seen[0][2]["lora_path"] == ["math", None]


def test_abort_finish_reason_in_sglang_shape():
    # what SGLang sends for a request aborted in its waiting queue: no tokens, extra keys
    abort = {"type": "abort", "message": "Abort in waiting queue", "status_code": None, "err_type": None}
    reply = [{"text": "", "output_ids": [], "meta_info": {
        "id": "w", "finish_reason": abort, "weight_version": "default", "output_token_logprobs": []}}]
    engine, _ = fake_engine(replying(200, reply))
    (r,) = asyncio.run(engine.generate([GenerateRequest([1], rid="x")]))
    assert (r.finish_reason, r.output_ids, r.logprobs, r.rid) == ("abort", [], [], "x")


def test_http_500_raises_naming_the_url_status_and_message():
    engine, _ = fake_engine(replying(500, {"error": {"message": "CUDA out of memory"}}))
    with pytest.raises(EngineHTTPError, match=rf"{URL}/generate answered HTTP 500: CUDA out of memory"):
        asyncio.run(engine.generate([GenerateRequest([1])]))
    engine, _ = fake_engine(replying(422, {"detail": [{"loc": ["body", "rid"], "msg": "bad"}]}))  # FastAPI's shape
    with pytest.raises(EngineHTTPError, match="HTTP 422: .*'msg': 'bad'"):
        asyncio.run(engine.generate([GenerateRequest([1])]))
    engine, _ = fake_engine(replying(503, b"upstream unavailable"))
    with pytest.raises(EngineHTTPError, match="HTTP 503: upstream unavailable") as err:
        asyncio.run(engine.abort())
    assert err.value.status == 503


def test_failed_weight_update_raises_and_keeps_the_version():
    replies = iter([
        (400, {"success": False, "message": "no weights at s3://b/v2", "num_paused_requests": 0}),
        (200, {"success": True, "message": "ok", "num_paused_requests": 0}),
    ])
    engine, seen = fake_engine(lambda method, url, body: next(replies))
    with pytest.raises(EngineHTTPError, match="update_weights_from_disk answered HTTP 400: no weights at s3://b/v2"):
        asyncio.run(engine.update_weights("s3://b/v2", 2))
    assert engine.weight_version == 0
    asyncio.run(engine.update_weights("s3://b/v2", 2))
    assert engine.weight_version == 2
    assert seen[1][2] == {
        "model_path": "s3://b/v2", "weight_version": "2", "flush_cache": True, "abort_all_requests": False}


def test_unreachable_server_is_named():
    # the real transport, to a port nobody listens on
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    engine = SGLangEngine(url, SGLangEngineConfig(url=url))
    with pytest.raises(EngineUnreachable, match=rf"{url}/generate: cannot reach the engine server"):
        asyncio.run(engine.generate([GenerateRequest([1])]))
    assert asyncio.run(engine.health()) is False
    asyncio.run(engine.close())
    with pytest.raises(RuntimeError, match="is closed"):
        asyncio.run(engine.abort())


def test_malformed_result_raises_naming_the_request():
    engine, _ = fake_engine(replying(200, [{"text": "", "meta_info": {"finish_reason": None}}]))
    with pytest.raises(EngineHTTPError, match="unexpected result for request 'q'"):
        asyncio.run(engine.generate([GenerateRequest([1], rid="q")]))
    engine, _ = fake_engine(replying(200, []))
    with pytest.raises(EngineHTTPError, match="expected 1 results, got 0 results"):
        asyncio.run(engine.generate([GenerateRequest([1])]))


def test_control_endpoints_and_their_bodies():
    engine, seen = fake_engine(replying(200, {"status": "ok"}))
    asyncio.run(engine.pause())
    asyncio.run(engine.resume())
    asyncio.run(engine.abort())
    assert asyncio.run(engine.health()) is True
    assert [(method, url.removeprefix(URL)) for method, url, _ in seen] == [
        ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/abort_request"), ("GET", "/health")]
    assert [body for _, _, body in seen[:3]] == [{"mode": "in_place"}, {}, {"abort_all": True}]


def test_weight_version_strings():
    assert [parse_weight_version(v) for v in (None, "default", "0", "12", 4)] == [0, 0, 0, 12, 4]
    with pytest.raises(ValueError, match="'step-3' is not an integer version"):
        parse_weight_version("step-3")


def test_config_variants():
    cfg = RunConfig.model_validate({"engine": {"type": "sglang", "url": "http://h:30000"}, "eval": {"engine": "shared"}})
    assert isinstance(cfg.engine, SGLangEngineConfig) and cfg.engine.url == "http://h:30000"
    assert RunConfig.model_validate(cfg.model_dump()).engine == cfg.engine  # a dumped config reloads
    launched = SGLangEngineConfig(cpu_affinity=[1], num_threads=1)
    assert launched.url is None and launched.launch == "hf-server"
    with pytest.raises(ValueError, match="cpu_affinity would be ignored"):
        SGLangEngineConfig(url="http://h:30000", cpu_affinity=[1])
    with pytest.raises(ValueError, match="must start with http"):
        SGLangEngineConfig(url="h:30000")


def test_client_and_server_modules_import_without_torch():
    code = (
        "import sys, miles_core.engines.sglang, miles_core.engines.server\n"
        "heavy = [m for m in ('torch', 'transformers', 'starlette', 'uvicorn', 'aiohttp') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


class StuckTransport:
    """``/generate`` answers after ``generate_s`` (None: never); ``/health`` answers at once when
    ``healthy``, else never (a frozen server accepts connections and answers nothing)."""

    def __init__(self, generate_s: float | None, healthy: bool) -> None:
        self.generate_s, self.healthy = generate_s, healthy

    async def request(self, method, url, body, timeout):
        if url.endswith("/health"):
            if self.healthy:
                return 200, b""
        elif self.generate_s is not None:
            await asyncio.sleep(self.generate_s)
            return 200, json.dumps([item([5], [-0.5], {"type": "length", "length": 1})]).encode()
        await asyncio.Event().wait()

    async def close(self):
        pass


def test_a_frozen_server_fails_its_requests_at_the_health_deadline_naming_what_was_pending(caplog):
    cfg = SGLangEngineConfig(url=URL, health_warn_s=0.1, health_timeout_s=0.4, coalesce_window_s=0)
    engine = SGLangEngine(URL, cfg, transport=StuckTransport(None, healthy=False))
    _made.append(engine)
    with caplog.at_level("WARNING"), pytest.raises(EngineUnreachable) as err:
        asyncio.run(engine.generate([GenerateRequest([1])]))
    text = str(err.value)
    assert text.startswith(f"{URL}: the engine server gave no sign of life for ") and "engine.health_timeout_s = 0.4" in text
    assert "1 request(s) pending (/generate; the oldest for " in text
    assert any(f"the engine server at {URL} has not answered" in r.message for r in caplog.records)


def test_a_slow_reply_from_a_healthy_server_is_waited_for():
    cfg = SGLangEngineConfig(url=URL, health_warn_s=0.1, health_timeout_s=0.2, coalesce_window_s=0)
    engine = SGLangEngine(URL, cfg, transport=StuckTransport(0.6, healthy=True))
    _made.append(engine)
    [result] = asyncio.run(engine.generate([GenerateRequest([1])]))
    assert result.output_ids == [5]


def test_a_weight_push_with_no_answer_is_sent_again_then_fails_naming_the_url(monkeypatch, tmp_path):
    """A push cut off (a frozen server back again resets its connection) is sent again; three
    silences fail it, naming the URL and each attempt. Its deadline is sized to the snapshot."""
    import miles_core.engines.http as http

    monkeypatch.setattr(http, "CONTROL_RETRY_DELAY_S", 0.0)
    snapshot = tmp_path / "model.safetensors"
    snapshot.write_bytes(b"\0" * 1000)
    timeouts: list[float] = []
    replies = iter([EngineUnreachable(f"{URL}/update_weights_from_disk: reset"), (200, {"success": True})])

    def flaky(method, url, body):
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    class Timed(FakeTransport):
        async def request(self, method, url, body, timeout):
            timeouts.append(timeout)
            return await super().request(method, url, body, timeout)

    engine = SGLangEngine(URL, SGLangEngineConfig(url=URL, request_timeout_s=600), transport=Timed(flaky))
    _made.append(engine)
    asyncio.run(engine.update_weights(str(snapshot), 4))
    assert engine.weight_version == 4 and len(timeouts) == 2
    assert timeouts[0] == pytest.approx(http.CONTROL_TIMEOUT_S + 1000 / http.PUSH_MIN_BYTES_PER_S)
    assert engine.push_timeout_s(str(tmp_path / "nowhere")) == 600, "an unseen snapshot: the configured bound"

    def refused(method, url, body):
        raise EngineUnreachable(f"{url}: cannot reach the engine server (connection refused)")

    engine, seen = fake_engine(refused)
    with pytest.raises(EngineUnreachable, match=rf"^{URL}/update_weights_from_disk: no answer in 3 attempt\(s\)"):
        asyncio.run(engine.update_weights(str(snapshot), 5))
    assert len(seen) == 3 and engine.weight_version == 0

    def frozen(method, url, body):  # the push's own deadline passes, and /health stays silent
        raise (EngineUnreachable if url.endswith("/health") else EngineTimeout)(f"{url}: no answer within 1 s")

    engine = SGLangEngine(URL, SGLangEngineConfig(url=URL, health_timeout_s=0.3), transport=FakeTransport(frozen))
    _made.append(engine)
    with pytest.raises(EngineUnreachable, match=r"no answer in 1 attempt\(s\) .*/health unanswered for 0\.3 s since"):
        asyncio.run(engine.update_weights(str(snapshot), 5))
