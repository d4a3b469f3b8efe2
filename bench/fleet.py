"""Benchmark: a rollout fleet of 1, 2, 4 and 8 producers through S3 (moto's server) feeding one
trainer of fixed step time, side by side in one invocation.

Run: ``.venv/bin/python bench/fleet.py [--producers 1 2 4 8 --steps 20 --step-s 0.25]``

Each producer is the real fleet member (``RolloutProducer`` with its ``ProducerLink``: prompt
claims from the run's prompt log, its own segment prefix, heartbeats, stop through storage) on a
scripted engine of fixed per-token latency (``--token-latency``, ``--tokens``, at most
``--concurrency`` samples in flight), so that producers wait on the engine rather than compete
for this machine's two cores. Each runs in a process of its own; everything between them and
the trainer goes through the S3 endpoint. The trainer is the real ``Fleet`` + ``GroupFeed`` (it
merges the producers' streams, one durable cursor each) with a training step of fixed length
(``--step-s`` of sleep). Per N it prints: produced samples/s (over the measured steps), that
ratio to N = 1 next to N itself, the trainer's idle fraction (time waiting for data / step), the
end-to-end sample latency (prompt claimed -> trained on; p50, p95), and the most groups the fleet
held ahead of the trainer against the buffer bound (``buffer_capacity_factor`` x batch).

Goal (from the issue): production grows at least 0.8 x N until it exceeds consumption; beyond
that, trainer idle < 5% and the buffer bound holds. Writes ``bench/results/fleet.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the scripted engine (tests/doubles) speaks the engine protocol
os.environ.setdefault("DO_NOT_TRACK", "1")


@dataclass
class Shape:
    batch: int
    n: int
    step_s: float
    token_latency: float
    tokens: int
    concurrency: int
    capacity_factor: float


def _cfg(shape: Shape, producers: int, root: str, opts: dict):
    from miles_core.config import RunConfig

    return RunConfig.model_validate({
        "name": "bench-fleet",
        "rollout": {"rollout_batch_size": shape.batch, "n_samples_per_prompt": shape.n,
                    "rollout_max_response_len": shape.tokens},
        "mode": {"type": "fully_async", "rollout_producers": producers, "max_concurrent_samples": shape.concurrency,
                 "buffer_capacity_factor": shape.capacity_factor, "segment_max_groups": 8,
                 "segment_max_wait_s": 0.2, "prompt_claim_size": 8, "producer_heartbeat_s": 0.5,
                 "control_poll_s": 0.5},
        "storage": {"root": root, "storage_options": opts},
    })


class ProcessLauncher:
    """Fleet members as processes of their own (``python bench/fleet.py --producer ID``), each with
    its own event loop and scripted engine, as on machines of their own: the trainer's process
    shares nothing with them but the S3 endpoint."""

    def __init__(self, cfg, refs, shape: Shape) -> None:
        self.cfg, self.refs, self.shape = cfg, refs, shape
        self.procs: dict[str, subprocess.Popen] = {}

    def launch(self, producer: str) -> None:
        cmd = [sys.executable, __file__, "--producer", producer, "--run-id", self.refs.run_id,
               "--run-dir", self.refs.run_dir]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, text=True)
        from miles_core.config import WITH_SECRETS

        cfg = self.cfg.model_dump(mode="json", context=WITH_SECRETS)  # the S3 credentials too: on stdin only
        proc.stdin.write(json.dumps({"cfg": cfg, "shape": asdict(self.shape)}))
        proc.stdin.close()
        self.procs[producer] = proc

    def ended(self, producer: str) -> str | None:
        from miles_core import processes

        return processes.ended(self.procs[producer])

    def stop(self, producer: str, timeout: float = 10.0) -> None:
        try:
            self.procs[producer].wait(timeout)
        except subprocess.TimeoutExpired:
            self.procs[producer].kill()

    def cancel(self, producer: str) -> None:
        self.procs[producer].terminate()

    def abandon(self, producer: str, reason: str) -> None:
        self.procs[producer].kill()


def produce(cfg, refs, shape: Shape, producer: str, cancel: threading.Event) -> None:
    """One fleet member on the scripted engine, until the run folder says stop."""
    from doubles.scripted_engine import ScriptedEngine

    from miles_core.engines.base import SamplingParams
    from miles_core.loop import LoopThread
    from miles_core.rewards import score_groups
    from miles_core.rollout.fleet import ControlPlane, Heartbeat, PromptLog, stream_name
    from miles_core.rollout.generate import PromptItem
    from miles_core.rollout.producer import RolloutProducer
    from miles_core.rollout.sampler import Generation
    from miles_core.rollout.worker import ClaimedPrompts, ProducerLink
    from miles_core.storage import RunLayout, SampleStream

    opts = cfg.storage.storage_options
    size = 100_000

    def draw(cursor, n):
        start = 0 if cursor is None else cursor
        return [(start + i) % size for i in range(n)], start + n

    def render(rows):
        now = time.time()
        return [PromptItem(f"p{r}", [1 + r % 50, 2, 3], str(r), r, {"t_claim": now}) for r in rows]

    async def score(groups):
        await score_groups(lambda s: float(len(s.response_ids) % 2), groups)

    layout = RunLayout(cfg.storage.root, cfg.name, refs.run_id, opts)
    stream = SampleStream(refs.run_dir, stream_name(producer), opts)
    prompts = ClaimedPrompts(PromptLog(refs.run_dir, opts, draw=draw), producer, render,
                             cfg.mode.prompt_claim_size)
    link = ProducerLink(ControlPlane(refs.run_dir, opts), Heartbeat(producer, "starting"),
                        cfg.mode.producer_heartbeat_s, cancel)
    loop = LoopThread(f"bench-{producer}")
    try:
        engine = ScriptedEngine(token_latency=shape.token_latency, default_tokens=shape.tokens)
        gen = Generation(engine, SamplingParams(max_new_tokens=shape.tokens), score)
        member = RolloutProducer(cfg, gen, prompts, stream, layout, None, link=link,
                                 state_file=f"state/producer-{producer}.json")
        stats = asyncio.run_coroutine_threadsafe(member.run(), loop.loop).result()
        link.beat(status="stopped", stats=asdict(stats), outstanding=0)
    finally:
        loop.close()


def producer_main(args) -> None:
    from miles_core.config import RunConfig
    from miles_core.run import RunRefs

    given = json.loads(sys.stdin.read())
    cancel = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: cancel.set())
    produce(RunConfig.model_validate(given["cfg"]), RunRefs(args.run_id, args.run_dir, ""), Shape(**given["shape"]),
            args.producer, cancel)


def run_fleet(shape: Shape, producers: int, steps: int, warmup: int, s3) -> dict:
    from miles_core.rollout.buffer import DefaultDataBuffer
    from miles_core.rollout.consumer import GroupFeed
    from miles_core.rollout.supervisor import Fleet
    from miles_core.run import RunRefs
    from miles_core.storage import RunLayout, SampleStream

    root = s3.make_bucket(f"fleet-{producers}-{int(time.time() * 1000) % 100000}")
    cfg = _cfg(shape, producers, root, s3.storage_options)
    layout = RunLayout(root, cfg.name, "r", s3.storage_options)
    refs = RunRefs("r", layout.run_dir, "")
    launcher = ProcessLauncher(cfg, refs, shape)
    fleet = Fleet(cfg, refs, launcher, SampleStream(refs.run_dir, "rollout", s3.storage_options), warn=print)
    capacity = max(1, round(shape.capacity_factor * shape.batch))
    feed = GroupFeed(fleet.base_stream, DefaultDataBuffer(cfg.mode, capacity=10 * capacity, first_version=0),
                     cfg.mode, streams=fleet.streams, producer_check=fleet.check, recycle=fleet.recycle,
                     poll_s=0.01)
    fleet.start()
    waits, step_times, latencies, ahead = [], [], [], []
    produced_at_start = t_start = None
    try:
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            batch = feed.next_batch(shape.batch, 0)
            now = time.time()
            time.sleep(shape.step_s)  # the training step
            feed.commit()
            if step == warmup:
                produced_at_start, t_start = _produced(fleet), time.perf_counter()
            if step >= warmup:
                waits.append(batch.wait_seconds)
                step_times.append(time.perf_counter() - t0)
                latencies += [now - g.samples[0].metadata["t_claim"] for g in batch.groups]
                ahead.append(sum(hb.outstanding for hb in fleet.control.heartbeats().values()))
        produced = _produced(fleet) - produced_at_start
        seconds = time.perf_counter() - t_start
    finally:
        fleet.stop(timeout=20)
    latencies.sort()
    return {
        "producers": producers,
        "produced_qps": produced / seconds,
        "consumed_qps": shape.batch * shape.n * len(step_times) / sum(step_times),
        "idle": sum(waits) / sum(step_times),
        "lat_p50": latencies[len(latencies) // 2],
        "lat_p95": latencies[int(0.95 * (len(latencies) - 1))],
        "ahead_max": max(ahead),
        "capacity": capacity,
    }


def _produced(fleet) -> int:
    return sum(hb.stats.get("samples_finished", 0) for hb in fleet.control.heartbeats().values())


def render(results: list[dict], shape: Shape, args) -> str:
    base = results[0]["produced_qps"]
    per_producer = shape.concurrency / (shape.tokens * shape.token_latency)
    consume = shape.batch * shape.n / shape.step_s
    load = os.getloadavg()
    lines = [
        f"Workload: scripted engine, {shape.tokens} tokens per sample at {shape.token_latency * 1000:.0f} ms per token, "
        f"at most {shape.concurrency} samples in flight per producer (so ~{per_producer:.0f} samples/s each); trainer "
        f"steps of {shape.batch} groups x {shape.n} samples taking {shape.step_s} s (consumes at most "
        f"{consume:.0f} samples/s); buffer bound {shape.capacity_factor} x {shape.batch} groups; {args.steps} measured "
        f"steps after {args.warmup}; storage: moto S3 on 127.0.0.1; load average before: {load[0]:.2f}.",
        "",
        "| producers | produced samples/s | vs 1 producer | N | consumed samples/s | trainer idle | "
        "latency p50 | latency p95 | most groups ahead / bound |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['producers']} | {r['produced_qps']:.0f} | {r['produced_qps'] / base:.2f}x | {r['producers']} | "
            f"{r['consumed_qps']:.0f} | {100 * r['idle']:.1f}% | {r['lat_p50']:.2f} s | {r['lat_p95']:.2f} s | "
            f"{r['ahead_max']} / {r['capacity']} |")
    lines += ["", "Goals (from the issue); the trainer's capacity is what it consumes per second of not waiting:"]
    for r in results:
        n = r["producers"]
        trainer_capacity = r["consumed_qps"] / max(1e-3, 1 - r["idle"])
        if n * base < trainer_capacity:
            ok = r["produced_qps"] >= 0.8 * n * base
            lines.append(f"- {n} producer(s), N x one producer's rate below the trainer's capacity "
                         f"({trainer_capacity:.0f}/s): production grows >= 0.8 x N: "
                         f"{'MET' if ok else 'NOT MET'} ({r['produced_qps'] / base:.2f}x vs {0.8 * n:.1f}x)")
        else:
            ok = r["idle"] < 0.05
            lines.append(f"- {n} producer(s), production above the trainer's capacity ({trainer_capacity:.0f}/s): "
                         "trainer idle < 5%: "
                         f"{'MET' if ok else 'NOT MET'} ({100 * r['idle']:.1f}%); buffer bound "
                         f"{'held' if r['ahead_max'] <= r['capacity'] else 'EXCEEDED'} "
                         f"({r['ahead_max']} groups ahead at most, bound {r['capacity']})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--producers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.25)
    parser.add_argument("--token-latency", type=float, default=0.1)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--capacity-factor", type=float, default=8.0,
                        help="the buffer bound in batches; latency-bound generation needs bound >= rate x latency")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "fleet.md"))
    parser.add_argument("--producer", help=argparse.SUPPRESS)  # a fleet member's process (launched by the bench)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.producer:
        return producer_main(args)
    shape = Shape(args.batch, args.n, args.step_s, args.token_latency, args.tokens, args.concurrency,
                  args.capacity_factor)
    from miles_core.storage.local_s3 import LocalS3

    results = []
    with LocalS3() as s3:
        for n in args.producers:
            print(f"[{n} producer(s)] ...", file=sys.stderr)
            results.append(run_fleet(shape, n, args.steps, args.warmup, s3))
    text = render(results, shape, args)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    cmd = " ".join(["python bench/fleet.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.out).write_text(f"Command: `.venv/bin/{cmd}`\n\n{text}")


if __name__ == "__main__":
    main()
