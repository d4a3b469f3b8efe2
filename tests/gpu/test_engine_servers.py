"""The engine contract against real SGLang and vLLM servers on a CUDA device.

``scripts/gpu_check.sh`` runs it. Each engine's server runs from the Python that has it installed:
``MILES_SGLANG_PYTHON`` / ``MILES_VLLM_PYTHON`` (default: ``python3`` when it imports the engine).
Skipped, saying why, without a CUDA device or without the engine.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_for
from contract.engine_contract import EngineContract, UnseenProgress, build_server_model

from miles_core import processes
from miles_core.config import SGLangEngineConfig, VLLMEngineConfig
from miles_core.engines.sglang import SGLangEngine
from miles_core.engines.vllm import SERVED_NAME, LocalVLLMServer, VLLMEngine

pytestmark = pytest.mark.gpu


def _cuda() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def engine_python(module: str) -> str | None:
    """The Python that runs ``module``'s server (``MILES_<MODULE>_PYTHON``, else python3), if it imports it."""
    python = os.environ.get(f"MILES_{module.upper()}_PYTHON") or shutil.which("python3") or sys.executable
    ok = subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0
    return python if ok else None


needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs a CUDA device (nvidia-smi -L found none)")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_server_model(tmp_path_factory.mktemp("tiny-model-gpu"))


async def restore(client, model_dir: str) -> None:
    """Put a shared server back as a fresh one (nothing running or paused, the original weights)
    through ``client``, then close it."""
    await client.abort()
    await client.resume()
    await client.update_weights(model_dir, 0)
    await client.close()


class SGLangServer:
    """``python -m sglang.launch_server`` over ``model_dir`` under our watchdog (its group goes down
    with this process), waited for on ``/health``."""

    def __init__(self, python: str, model_dir: str, seed: int = 0, log_dir: str = ".") -> None:
        self.python, self.model_dir, self.seed = python, model_dir, seed
        self.port = processes.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = str(Path(log_dir) / f"sglang-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> SGLangServer:
        from miles_core.engines.server import _http
        from miles_core.engines.sglang import launch_args

        watchdog = Path(__file__).resolve().parents[2] / "miles_core" / "engines" / "watchdog.py"
        cmd = [self.python, str(watchdog), "--parent-pid", str(os.getpid()), "--log", self.log, "--",
               self.python, "-m", "sglang.launch_server", *launch_args(self.model_dir, port=self.port, seed=self.seed)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        try:
            wait_for(lambda: _http(f"{self.url}/health", timeout=2) == 200 or self.proc.poll() is not None, 300,
                     "the SGLang server's /health", poll=1)
            assert self.proc.poll() is None, f"SGLang server exited with code {self.proc.returncode}"
        except AssertionError as e:
            tail = Path(self.log).read_text(errors="replace")[-3000:] if Path(self.log).exists() else ""
            self.stop()
            raise RuntimeError(f"SGLang server did not start ({self.log}): {e}\n{tail}") from None
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            processes.terminate(proc)


@needs_cuda
@pytest.mark.skipif(engine_python("sglang") is None, reason="needs sglang (pip install sglang; or MILES_SGLANG_PYTHON)")
class TestSGLangServerContract(UnseenProgress, EngineContract):
    logprob_atol = 1e-3

    @pytest.fixture(scope="class")
    def server(self, tiny_model_dir, tmp_path_factory):
        server = SGLangServer(engine_python("sglang"), str(tiny_model_dir), log_dir=str(tmp_path_factory.mktemp("sglang"))).start()
        yield server
        server.stop()

    @pytest.fixture
    def engine(self, server, tiny_model_dir):
        cfg = SGLangEngineConfig(url=server.url, coalesce_window_s=0)
        eng = SGLangEngine(server.url, cfg)
        yield eng
        asyncio.run(eng.close())
        asyncio.run(restore(SGLangEngine(server.url, cfg), str(tiny_model_dir)))

    def make_engine(self, model_dir: str, seed: int = 0):
        server = SGLangServer(engine_python("sglang"), model_dir, seed=seed).start()
        return SGLangEngine(server.url, SGLangEngineConfig(url=server.url, coalesce_window_s=0), server=server)


@needs_cuda
@pytest.mark.skipif(engine_python("vllm") is None, reason="needs vllm (pip install vllm; or MILES_VLLM_PYTHON)")
class TestVLLMServerContract(UnseenProgress, EngineContract):
    logprob_atol = 1e-3
    truncation_renormalises_logprobs = True

    @staticmethod
    def cfg() -> VLLMEngineConfig:
        return VLLMEngineConfig(python=engine_python("vllm"), max_model_len=2100, max_num_seqs=64,
                                extra_args=["--gpu-memory-utilization", "0.3"])

    @pytest.fixture(scope="class")
    def server(self, tiny_model_dir, tmp_path_factory):
        log = str(tmp_path_factory.mktemp("vllm") / "server.log")
        with LocalVLLMServer(str(tiny_model_dir), self.cfg(), lora=True, log_path=log) as server:
            yield server

    @pytest.fixture
    def engine(self, server, tiny_model_dir):
        eng = VLLMEngine(server.url, self.cfg(), model=SERVED_NAME, model_dir=str(tiny_model_dir))
        yield eng
        asyncio.run(eng.close())
        asyncio.run(restore(VLLMEngine(server.url, self.cfg(), model=SERVED_NAME, model_dir=str(tiny_model_dir)),
                            str(tiny_model_dir)))

    @pytest.fixture(autouse=True)
    def _shared_server(self, server):
        self.server = server

    def make_engine(self, model_dir: str, seed: int = 0):
        """A new client of the shared server: unseeded requests get seeds from the client's ``seed``."""
        return VLLMEngine(self.server.url, self.cfg(), model=SERVED_NAME, model_dir=model_dir, seed=seed)
