"""One rank of a launched DeepSpeed trainer (``python -m miles_core.train.worker SPEC``).

Started by ``launch.LaunchedTrainer`` through torchrun or the deepspeed launcher, which set RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. The rank sends its output to
``rank-<r>.log`` in SPEC's folder, connects to the parent (address and authkey from SPEC, a pickle the
parent wrote), builds its ``DeepSpeedTrainer`` (which joins the process group), says ``ready``, then
runs the parent's commands one by one and answers each with ``(status, result, version)``. Only
rank 0 sends results back (the others send None). On an error it sends the traceback and exits
with code 1; on ``close`` it leaves the process group and exits with 0.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from multiprocessing.connection import Client

from miles_core import processes
from miles_core.train.launch import recv, send

# the parent's calls a rank runs; each is collective over the ranks
COMMANDS = ("step", "export", "save", "load", "weights")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m miles_core.train.worker SPEC (started by miles_core.train.launch)", file=sys.stderr)
        return 2
    processes.die_with_parent()
    rank = int(os.environ["RANK"])
    _log_to(os.path.join(os.path.dirname(os.path.abspath(argv[0])), f"rank-{rank}.log"))  # the spec's folder
    with open(argv[0], "rb") as f:
        spec = pickle.load(f)
    conn = Client(tuple(spec["address"]), authkey=spec["authkey"])
    send(conn, ("hello", rank, os.getpid()))
    try:
        trainer = _build(spec)
    except BaseException:
        traceback.print_exc()
        send(conn, ("error", traceback.format_exc(), None))
        return 1
    send(conn, ("ready", None, trainer.version))
    return _serve(conn, trainer, rank)


def _build(spec: dict):
    from miles_core.config import LoraConfig, TrainConfig
    from miles_core.train.deepspeed_trainer import DeepSpeedTrainer

    lora = None if spec["lora"] is None else LoraConfig.model_validate(spec["lora"])
    return DeepSpeedTrainer(
        spec["model_dir"],
        TrainConfig.model_validate(spec["train_cfg"]),
        spec["weight_store"],
        dtype=spec["dtype"],
        initial_version=spec["initial_version"],
        storage_options=spec["storage_options"],
        lora=lora,
    )


def _serve(conn, trainer, rank: int) -> int:
    import torch.distributed as dist

    while True:
        try:
            command, args = recv(conn)
        except EOFError:  # the parent is gone
            return 1
        if command == "close":
            dist.destroy_process_group()
            return 0
        try:
            if command not in COMMANDS:
                raise ValueError(f"unknown trainer command {command!r}")
            result = getattr(trainer, command)(*args)
        except BaseException:
            traceback.print_exc()
            send(conn, ("error", traceback.format_exc(), None))
            return 1
        send(conn, ("ok", result if rank == 0 else None, trainer.version))


def _log_to(path: str) -> None:
    """Send this process's stdout and stderr (Python's and native code's) to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
