"""The DeepSpeed trainer over several processes: ``LaunchedTrainer``, a ``Trainer`` that drives ranks.

- ``setup_deepspeed(...)``: ``DeepSpeedTrainer`` in this process when ``num_processes`` is 1,
  else a ``LaunchedTrainer`` (``setup_trainer`` calls it for ``train.backend.type = "deepspeed"``).
- ``LaunchedTrainer`` starts ``num_processes`` ranks of ``miles_core.train.worker`` on this machine
  with the configured launcher (``torchrun``: ``python -m torch.distributed.run``; ``deepspeed``: the
  deepspeed launcher) and talks to every rank over a ``multiprocessing.connection`` socket on
  127.0.0.1 (random authkey). The ranks read what they need (train config, model folder, weight
  store, dtype, LoRA config, the socket's address and key) from a pickle in a private temp folder
  (so the weight store must be picklable and importable in a fresh process),
  build a ``DeepSpeedTrainer`` each and join one process group (gloo on CPU, NCCL on CUDA).
- Each call (``step``, ``export``, ``save``, ``load``, ``weights``) goes to every rank, since the
  trainer's methods are collective; the reply of rank 0 (metrics, URI) is the answer. Only rank 0
  publishes weights.
- Failures are loud: a rank that raises, or exits, or a launcher that exits, stops the whole group
  and raises ``TrainerProcessError`` naming the rank, the exit code and the tail of its log (each
  rank logs to ``rank-<r>.log``, the launcher to ``launcher.log``, in the temp folder, kept after a
  failure; the spec pickle is deleted once read); waiting longer than ``startup_timeout_s`` for
  the ranks names the ranks still missing.
- ``close()`` asks the ranks to leave their process group and exit, then waits for the launcher.
"""

from __future__ import annotations

import os
import pickle
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_core import processes
from miles_core.config import DeepSpeedTrainerConfig, TrainConfig

if TYPE_CHECKING:
    from miles_core.config import LoraConfig
    from miles_core.train.base import TrainBatch, Trainer

_CLOSE_WAIT_S = 60.0  # for the ranks to leave the group and the launcher to exit
_EXIT_WAIT_S = 15.0  # after a rank failed: for the launcher to report its exit
_TERM_WAIT_S = 10.0  # after SIGTERM: for the launcher to stop its ranks


class TrainerProcessError(RuntimeError):
    """A rank of a launched trainer failed, exited, or did not start in time."""


def setup_deepspeed(model_dir: str, train_cfg: TrainConfig, *args: Any, **kwargs: Any) -> Trainer:
    """The DeepSpeed trainer of ``train_cfg.backend``: in this process, or launched over several
    (the arguments are ``LaunchedTrainer``'s)."""
    backend = train_cfg.backend
    assert isinstance(backend, DeepSpeedTrainerConfig)
    if backend.num_processes == 1:
        from miles_core.train.deepspeed_trainer import DeepSpeedTrainer

        return DeepSpeedTrainer(model_dir, train_cfg, *args, **kwargs)
    return LaunchedTrainer(model_dir, train_cfg, *args, **kwargs)


class LaunchedTrainer:
    def __init__(
        self,
        model_dir: str,
        train_cfg: TrainConfig,
        weight_store: Any,
        dtype: str = "float32",
        initial_version: int = 0,
        storage_options: dict[str, Any] | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        backend = train_cfg.backend
        if not isinstance(backend, DeepSpeedTrainerConfig):
            raise TypeError(f"LaunchedTrainer needs train.backend.type='deepspeed', got {backend.type!r}")
        self.backend = backend
        self.num_processes = backend.num_processes
        self._version = initial_version
        self._failed = False
        self._stopped = False  # the launcher was still running when we stopped it
        self._conns: dict[int, Connection] = {}
        self.pids: dict[int, int] = {}
        """Process id of each rank."""
        self.dir = Path(tempfile.mkdtemp(prefix="miles-trainer-"))  # mode 0700: the authkey lives here
        authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        spec = {
            "model_dir": str(model_dir),
            "train_cfg": train_cfg.model_dump(mode="json"),
            "weight_store": weight_store,
            "dtype": dtype,
            "initial_version": initial_version,
            "storage_options": storage_options,
            "lora": None if lora is None else lora.model_dump(mode="json"),
            "address": self._listener.address,
            "authkey": authkey,
        }
        spec_path = self.spec_path = self.dir / "spec.pkl"
        with open(os.open(spec_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            pickle.dump(spec, f)
        self._launcher_log = open(self.dir / "launcher.log", "wb")
        self._proc = subprocess.Popen(
            launch_command(backend, str(spec_path)),
            stdout=self._launcher_log,
            stderr=subprocess.STDOUT,
            env=_launch_env(backend),
            start_new_session=True,  # its own process group: close() and failures stop every rank
        )
        self._finalizer = weakref.finalize(self, _stop, self._proc, self.pids)
        try:
            self._connect(time.monotonic() + backend.startup_timeout_s)
        except BaseException:
            if not self._failed:  # e.g. KeyboardInterrupt: do not leave the ranks running
                self._fail(wait_for_exit=False)
            raise

    # -------------------------------------------------------------------------------- protocol

    @property
    def version(self) -> int:
        return self._version

    def step(self, batch: TrainBatch) -> dict[str, float]:
        return self._call("step", batch)

    def export(self, version: int) -> str:
        return self._call("export", version)

    def weights(self) -> dict[str, Any]:
        return self._call("weights")

    def save(self, uri: str) -> None:
        self._call("save", uri)

    def load(self, uri: str) -> None:
        self._call("load", uri)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("a launched trainer's state lives in its ranks: use save(uri) / load(uri)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state_dict()

    def close(self) -> None:
        """Ask every rank to leave its process group and exit; stop them if they do not."""
        if self._proc.poll() is None and not self._failed and len(self._conns) == self.num_processes:
            try:
                for conn in self._conns.values():
                    send(conn, ("close", ()))
                deadline = time.monotonic() + _CLOSE_WAIT_S
                self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._shutdown()
        if not self._failed:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -------------------------------------------------------------------------------- plumbing

    def _connect(self, deadline: float) -> None:
        """Accept every rank's connection, then wait until each has built its trainer."""
        accepted: queue.Queue[Connection] = queue.Queue()
        threading.Thread(target=_accept_all, args=(self._listener, self.num_processes, accepted), daemon=True).start()
        while len(self._conns) < self.num_processes:
            try:
                conn = accepted.get(timeout=1.0)
            except queue.Empty:
                self._check_launcher(f"waiting for ranks {self._missing()} to connect")
                if time.monotonic() > deadline:
                    self._fail(wait_for_exit=False)
                    raise self._error(
                        f"timed out after {self.backend.startup_timeout_s:g} s waiting for trainer ranks "
                        f"{self._missing()} of {self.num_processes} to start and connect", tail_ranks=self._missing()
                    ) from None
                continue
            _, rank, pid = recv(conn)
            self._conns[rank], self.pids[rank] = conn, pid
        self._gather("ready", deadline)
        self.spec_path.unlink()  # every rank has read it

    def _call(self, command: str, *args: Any) -> Any:
        if self._failed:
            raise TrainerProcessError(f"the launched trainer failed earlier; its logs are in {self.dir}")
        for rank, conn in self._conns.items():
            try:
                send(conn, (command, args))
            except OSError:
                self._fail()
                raise self._error(f"trainer rank {rank} is gone (sending {command!r})", tail_ranks=[rank]) from None
        return self._gather(command, None)

    def _gather(self, what: str, deadline: float | None) -> Any:
        """Every rank's reply to ``what``; rank 0's result. Raises on the first failure."""
        pending = dict(self._conns)
        result = None
        while pending:
            ready = wait(list(pending.values()), timeout=1.0)
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    status, payload, version = recv(conn)
                except (EOFError, OSError):
                    self._fail()
                    raise self._error(f"trainer rank {rank} exited during {what!r}", tail_ranks=[rank]) from None
                if status == "error":
                    # a rank that died makes the others fail in their collectives: name it first
                    dead = [r for r in sorted(pending) if r != rank and not processes.alive(self.pids.get(r, 0))]
                    self._fail()
                    if dead:
                        raise self._error(f"trainer rank {dead[0]} exited during {what!r} (rank {rank} failed after "
                                          f"it:\n{payload})", tail_ranks=[dead[0], rank])
                    raise self._error(f"trainer rank {rank} failed during {what!r}:\n{payload}", tail_ranks=[rank])
                del pending[rank]
                if rank == 0:
                    result, self._version = payload, version
            if not ready:
                self._check_launcher(f"waiting for {what!r} from ranks {sorted(pending)}")
                if deadline is not None and time.monotonic() > deadline:
                    self._fail(wait_for_exit=False)
                    raise self._error(
                        f"timed out after {self.backend.startup_timeout_s:g} s waiting for trainer ranks "
                        f"{sorted(pending)} of {self.num_processes} to build their trainer", tail_ranks=sorted(pending)
                    )
        return result

    def _check_launcher(self, doing: str) -> None:
        if self._proc.poll() is not None:
            self._fail()
            raise self._error(f"the {self.backend.launcher} launcher exited while {doing}", tail_ranks=self._missing())

    def _missing(self) -> list[int]:
        return [r for r in range(self.num_processes) if r not in self._conns]

    def _fail(self, wait_for_exit: bool = True) -> None:
        """Mark this trainer failed and stop its ranks; after a rank's failure, first give the
        launcher time to notice it and report each rank's exit code."""
        self._failed = True
        if wait_for_exit:
            try:
                self._proc.wait(timeout=_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        self._shutdown()

    def _shutdown(self) -> None:
        self.spec_path.unlink(missing_ok=True)  # it holds the authkey and the storage options
        for conn in self._conns.values():
            conn.close()
        self._listener.close()
        self._stopped = bool(self._finalizer()) or self._stopped
        self._launcher_log.close()

    def _error(self, message: str, tail_ranks: list[int]) -> TrainerProcessError:
        code = "none: it was still running, and was stopped" if self._stopped else self._proc.poll()
        parts = [message, f"launcher exit code: {code}"]
        for rank in tail_ranks:
            log = self.dir / f"rank-{rank}.log"
            parts.append(f"--- rank {rank} log ({log}), last lines:\n{_tail(log)}")
        parts.append(f"--- launcher log ({self.dir / 'launcher.log'}), last lines:\n{_tail(self.dir / 'launcher.log')}")
        return TrainerProcessError("\n".join(parts))


def send(conn: Connection, message: Any) -> None:
    """Plain pickle: ``Connection.send`` would use torch's reducers, which share tensors through file
    descriptors of this process, which the other side (not a child of ours) cannot open."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def launch_command(backend: DeepSpeedTrainerConfig, spec_path: str) -> list[str]:
    """The command line that starts ``backend.num_processes`` workers on this machine."""

    n, port = str(backend.num_processes), str(processes.free_port())
    if backend.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", n,
                "--master-addr", "127.0.0.1", "--master-port", port, "-m", "miles_core.train.worker", spec_path]
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_nodes", "1", "--num_gpus", n,
            "--master_addr", "127.0.0.1", "--master_port", port, "--no_local_rank", "--module",
            "miles_core.train.worker", spec_path]


def _launch_env(backend: DeepSpeedTrainerConfig) -> dict[str, str]:
    env = processes.package_env()  # the ranks import this package from the same place as this process
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # this process's own group (if any) is not the ranks'
    if backend.device == "cpu":
        # the deepspeed launcher counts CPU "devices" by NUMA node unless told how many ranks
        env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(backend.num_processes))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _accept_all(listener: Listener, n: int, out: queue.Queue) -> None:
    """Accept ``n`` connections (a thread: ``Listener.accept`` has no timeout); stops when closed."""
    from multiprocessing import AuthenticationError

    accepted = 0
    while accepted < n:
        try:
            out.put(listener.accept())
            accepted += 1
        except AuthenticationError:  # not one of our ranks
            continue
        except (OSError, EOFError):  # the listener was closed
            return


def _stop(proc: subprocess.Popen, pids: dict[int, int]) -> bool:
    """Stop the launcher and its ranks if the launcher still runs; True if it did. SIGTERM first:
    torchrun and the deepspeed launcher then stop their ranks (which run in sessions of their own,
    out of reach of a signal to the launcher's group); then SIGKILL whatever is left."""
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=_TERM_WAIT_S)
        return True
    except subprocess.TimeoutExpired:
        pass
    processes.signal_group(proc.pid, signal.SIGKILL)
    for pid in pids.values():  # ranks in sessions of their own
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    return True


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
    except FileNotFoundError:
        return "(no log)"
