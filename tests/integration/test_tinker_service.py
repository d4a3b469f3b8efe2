"""``miles tinker-serve`` driven by the official ``tinker`` SDK, unmodified, on the tiny model: every
call the SDK makes, four clients training at once (their calls fused, each result what training it
alone gives), kill -9 of the service and resuming from a saved state, and a wrong API key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.waiting import wait_for
from tinker_serving import KEY, REPO, tinker_serve

pytestmark = pytest.mark.integration


@pytest.fixture
def sdk(monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker

    return tinker


def _stats(url: str) -> dict:
    req = urllib.request.Request(f"{url}/api/v1/miles/stats", headers={"X-API-Key": KEY})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _datum(types, tok, question: str, answer: str):
    prompt, target = tok.encode(question), tok.encode(answer)
    tokens = prompt + target
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(target)})


def test_every_call_of_the_sdk(tmp_path: Path, sdk) -> None:
    types = sdk.types
    with tinker_serve(tmp_path / "store") as (url, _), sdk.ServiceClient(base_url=url, api_key=KEY) as service:
        caps = service.get_server_capabilities()
        assert [m.model_name for m in caps.supported_models] == ["tiny-addition"]
        tc = service.create_lora_training_client(base_model="tiny-addition", rank=4).result()
        info = tc.get_info()
        assert (info.model_data.model_name, info.lora_rank, info.is_lora) == ("tiny-addition", 4, True)
        tok = tc.get_tokenizer()
        datum = _datum(types, tok, "12+34=", "46\n")

        before = tc.forward([datum], "cross_entropy").result()
        losses = []
        for _ in range(4):  # the same datum, again and again: its loss must fall
            fb = tc.forward_backward([datum], "cross_entropy").result()
            losses.append(fb.metrics["loss:sum"])
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert losses[0] == pytest.approx(before.metrics["loss:sum"], rel=1e-5)  # forward changed nothing
        assert losses[-1] < 0.5 * losses[0], losses
        n = len(datum.model_input.to_ints())
        assert len(fb.loss_fn_outputs[0]["logprobs"].tolist()) == n

        # the RL losses take the sampler's logprobs and advantages
        rl = types.Datum(model_input=datum.model_input, loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"], "logprobs": [-1.0] * n,
            "advantages": [0.0] * (n - 3) + [1.0] * 3})
        for loss_fn in ("importance_sampling", "ppo"):
            out = tc.forward_backward([rl], loss_fn).result()
            assert np.isfinite(out.metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        with pytest.raises(sdk.RequestFailedError, match="'cispo' is not supported"):
            tc.forward_backward([rl], "cispo").result()

        # sampling: from a snapshot by path, from the client's current weights, from the base model
        state = tc.save_state("after-training").result()
        assert state.path.endswith("/weights/after-training")
        sampler_path = tc.save_weights_for_sampler("final").result().path
        assert sampler_path.startswith("tinker://") and sampler_path.endswith("/sampler_weights/final")
        with pytest.raises(sdk.RequestFailedError, match="never replaced"):
            tc.save_weights_for_sampler("final").result()
        prompt = types.ModelInput.from_ints(tok.encode("12+34="))
        params = types.SamplingParams(max_tokens=3, temperature=0.0)
        by_path = service.create_sampling_client(model_path=sampler_path)
        got = by_path.sample(prompt, 2, params).result()
        assert len(got.sequences) == 2 and all(len(s.tokens) == len(s.logprobs) == 3 for s in got.sequences)
        assert tok.decode(got.sequences[0].tokens).startswith("46")  # what it was trained to say
        current = tc.save_weights_and_get_sampling_client().result()
        assert current.sample(prompt, 1, params).result().sequences[0].tokens == got.sequences[0].tokens
        for _ in range(4):  # the service keeps a client's newest 4 unnamed snapshots
            newer = tc.save_weights_and_get_sampling_client().result()
        assert newer.sample(prompt, 1, params).result().sequences[0].tokens == got.sequences[0].tokens
        with pytest.raises(sdk.BadRequestError, match="older than the newest 4"):
            current.sample(prompt, 1, params).result()
        with pytest.raises(sdk.BadRequestError, match="topk_prompt_logprobs are not supported"):
            newer.sample(prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=2).result()
        base = service.create_sampling_client(base_model="tiny-addition")
        assert len(base.sample(prompt, 1, params).result().sequences[0].tokens) == 3

        # compute_logprobs agrees with the trainer's forward pass on the same weights
        logprobs = by_path.compute_logprobs(datum.model_input).result()
        assert logprobs[0] is None and len(logprobs) == n
        trained = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        np.testing.assert_allclose(logprobs[1:], trained[:-1], rtol=1e-4, atol=1e-4)

        # a new client from the saved state, optimizer included, continues where the first left off
        again = service.create_training_client_from_state_with_optimizer(state.path).result()
        a = again.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        assert a == pytest.approx(tc.forward([datum], "cross_entropy").result().metrics["loss:sum"], rel=1e-5)

        with pytest.raises(sdk.BadRequestError, match="not a checkpoint path"):  # the session is made on first use
            service.create_sampling_client(model_path="tinker://nothing").sample(prompt, 1, params).result()


def test_four_clients_at_once_are_fused_and_each_trains_as_if_alone(tmp_path: Path, sdk) -> None:
    types = sdk.types
    problems = [("1+2=", "3\n"), ("20+22=", "42\n"), ("5+5=", "10\n"), ("31+8=", "39\n")]

    def train(tc, k: int, steps: int = 3) -> list[float]:
        tok = tc.get_tokenizer()
        datum = _datum(types, tok, *problems[k])
        out = []
        for _ in range(steps):
            out.append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return out

    with tinker_serve(tmp_path / "store") as (url, _), sdk.ServiceClient(base_url=url, api_key=KEY) as service:
        clients = [service.create_lora_training_client(base_model="tiny-addition", rank=4, seed=k).result()
                   for k in range(4)]
        alone = [train(tc, k) for k, tc in enumerate(clients)]  # one client at a time: nothing to fuse
        assert max(_stats(url)["fused_sizes"]) == 1
        fresh = [service.create_lora_training_client(base_model="tiny-addition", rank=4, seed=k).result()
                 for k in range(4)]
        together: list[list[float] | None] = [None] * 4
        barrier = threading.Barrier(4)

        def run(k: int) -> None:
            barrier.wait()
            together[k] = train(fresh[k], k)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        sizes = _stats(url)["fused_sizes"]

    assert max(sizes) > 1, f"no forward_backward calls ran together: {sizes}"
    for k in range(4):
        np.testing.assert_allclose(together[k], alone[k], rtol=1e-4)


def test_kill_9_then_resume_from_the_last_saved_state(tmp_path: Path, sdk) -> None:
    types = sdk.types
    store = tmp_path / "store"
    from miles_core import processes

    port = processes.free_port()
    with tinker_serve(store, port) as (url, proc):
        service = sdk.ServiceClient(base_url=url, api_key=KEY)
        tc = service.create_lora_training_client(base_model="tiny-addition", rank=4).result()
        datum = _datum(types, tc.get_tokenizer(), "12+34=", "46\n")
        for _ in range(2):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        saved = tc.save_state("two-steps").result().path
        at_save = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # after the save: lost in the kill
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)

    with tinker_serve(store, port) as (url, _):
        with pytest.raises(sdk.RequestFailedError) as lost:
            tc.forward([datum], "cross_entropy").result()
        assert "restarted" in str(lost.value) and saved in str(lost.value) and "lost" in str(lost.value)
        resumed = service.create_training_client_from_state_with_optimizer(saved).result()
        again = resumed.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        assert again == pytest.approx(at_save, rel=1e-5)
        resumed.forward_backward([datum], "cross_entropy").result()  # and it trains on
        assert resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["optimizer_steps"] == 3
        service.close("success").result(timeout=30)  # while a service is there to hear it


def test_a_wrong_api_key_is_refused(tmp_path: Path, sdk) -> None:
    with tinker_serve(tmp_path / "store") as (url, _):
        service = sdk.ServiceClient(base_url=url, api_key="tml-not-the-key")
        with pytest.raises(sdk.AuthenticationError, match="wrong or missing API key"):
            service.create_lora_training_client(base_model="tiny-addition", rank=4).result()
    log = (tmp_path / "serve-store.log").read_text()
    assert KEY not in log and "tml-not-the-key" not in log


def test_each_training_client_is_a_prefect_flow_run(tmp_path: Path, sdk, prefect_backend: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterTags

    from miles_core import processes
    from miles_core.tinker.runs import run_key

    types = sdk.types
    store, port = tmp_path / "store", processes.free_port()

    def runs_by_model() -> dict:
        with get_client(sync_client=True) as client:
            found = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["tinker"])))
        return {r.parameters["model_id"]: r for r in found}

    with tinker_serve(store, port, prefect_api=prefect_backend) as (url, proc):
        with sdk.ServiceClient(base_url=url, api_key=KEY) as service:
            tc = service.create_lora_training_client(base_model="tiny-addition", rank=4).result()
            datum = _datum(types, tc.get_tokenizer(), "12+34=", "46\n")
            for _ in range(3):
                tc.forward_backward([datum], "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            saved = tc.save_state("three").result().path
            model_id = tc.model_id
        # the session finished when the ServiceClient closed: its client's run is Completed
        run = wait_for(lambda: (r := runs_by_model().get(model_id)) and r.state.is_completed() and r, 60,
                       "the finished client's flow run to be Completed")
        assert run.name.startswith("tiny-addition-r4-") and run.parameters["rank"] == 4
        with get_client(sync_client=True) as client:
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
                any_=[run_key(model_id, "steps"), run_key(model_id, "checkpoints")])))
        latest = {a.key: a for a in sorted(arts, key=lambda a: a.created)}
        steps = latest[run_key(model_id, "steps")].data
        assert [row["step"] for row in (steps if isinstance(steps, list) else json.loads(steps))] == [1, 2, 3]
        assert saved in latest[run_key(model_id, "checkpoints")].data

        service = sdk.ServiceClient(base_url=url, api_key=KEY)  # a client still training when ...
        live_id = service.create_lora_training_client(base_model="tiny-addition", rank=4).result().model_id
        wait_for(lambda: runs_by_model().get(live_id), 60, "the second client's flow run")
        os.kill(proc.pid, signal.SIGKILL)  # ... the service is killed
        proc.wait(30)
    with tinker_serve(store, port, prefect_api=prefect_backend):
        crashed = wait_for(lambda: (r := runs_by_model().get(live_id)) and r.state.is_crashed() and r, 60,
                           "the killed client's flow run to be Crashed after the restart")
        assert "restarted" in crashed.state.message and "no saved state" in crashed.state.message
        assert runs_by_model()[model_id].state.is_completed()  # the finished one stays finished
        service.close("success").result(timeout=30)  # while a service is there to hear it


def test_the_service_runs_as_a_flow_of_a_deployment(tmp_path: Path, sdk, prefect_backend: str) -> None:
    """``tinker-service/serve``'s flow, as a worker runs it: the API answers, the flow run is Running."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    from miles_core import processes

    port = processes.free_port()
    code = ("from flows.tinker import tinker_service; "
            f"tinker_service(base_models=['tiny-addition'], storage={str(tmp_path / 'store')!r}, port={port})")
    env = {**os.environ, "MILES_TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "PREFECT_API_URL": prefect_backend}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        wait_for(lambda: any("ready on" in ln for ln in lines) or proc.poll() is not None, 120,
                 "the tinker-service flow's ready line")
        assert proc.poll() is None, "".join(lines)[-3000:]
        with sdk.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY) as service:
            tc = service.create_lora_training_client(base_model="tiny-addition", rank=4).result()
            assert tc.get_info().lora_rank == 4
        with get_client(sync_client=True) as client:
            [run] = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["tinker-service"])))
        assert run.state.is_running()
        assert KEY not in "".join(lines)
    finally:
        processes.terminate(proc)


def test_a_result_survives_a_reconnect_and_an_unknown_request_is_named(tmp_path: Path) -> None:
    """The SDK's wire, spoken by hand: a future's result is there for a new connection too."""
    import httpx

    headers = {"X-API-Key": KEY}
    with tinker_serve(tmp_path / "store") as (url, _):
        with httpx.Client(base_url=url, headers=headers, timeout=60) as first:
            session = first.post("/api/v1/create_session", json={"tags": [], "type": "create_session"}).json()
            future = first.post("/api/v1/create_model", json={
                "session_id": session["session_id"], "model_seq_id": 0, "base_model": "tiny-addition",
                "lora_config": {"rank": 4}, "type": "create_model"}).json()
        answers = []
        for _ in range(2):  # two new connections, as a client that reconnects makes
            with httpx.Client(base_url=url, headers=headers, timeout=60) as again:
                answers.append(again.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).json())
        assert answers[0] == answers[1] == {"model_id": f"{session['session_id']}:train:0", "type": "create_model"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            lost = c.post("/api/v1/retrieve_future", json={"request_id": "forward_backward-nope"}).json()
        assert lost["category"] == "server" and "unknown to this service" in lost["error"]
