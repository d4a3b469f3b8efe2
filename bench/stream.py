"""Benchmark: SampleStream against raw fsspec on local files and on a local S3 endpoint (moto).

Run: ``.venv/bin/python bench/stream.py [--segments N --samples-per-segment N --response-len N]``

For each backend (``file://`` in a temp dir, ``s3://`` on ``LocalS3``) it measures:
(a) write throughput of ``SampleStream.append`` (samples/s, MiB/s of the encoded segment bytes);
(b) read throughput of one reader reading all segments;
(a') the same with the write-behind ``StreamWriter`` (encode and write of segment k overlap with
    the caller producing k+1; timed until the last segment is visible), the producer's way;
(c) end-to-end latency, append start -> a reader polling ``read()`` every ``--poll-ms`` in another
    thread sees the segment, with appends paced every ``--pace-ms``;
(d) the baseline: raw ``pipe_file`` / ``cat_file`` of the same encoded bytes (same sizes, same
    count), and for latency raw put + a thread polling ``cat`` (one GET) on the known key.

The stream does more than the raw calls: Arrow IPC + zstd encode/decode, temp file + fsync +
link on local disk, and a prefix listing per ``read()``. On local disk a second baseline writes
each payload with write + fsync, the durability the stream gives. The ratio column shows what that costs.
Goals (from the issue): stream throughput within 15% of raw (ratio >= 0.85); end-to-end p50 under
100 ms on local moto. Prints a markdown table and writes it to ``bench/results/stream.md``.
Only public APIs of ``miles_core`` are used.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_core.storage import SampleStream, join, open_fs  # noqa: E402
from miles_core.storage.local_s3 import LocalS3  # noqa: E402
from miles_core.types import arrow_schema  # noqa: E402

MiB = 1 << 20
VOCAB = 151_936  # a Qwen-sized vocabulary: token ids need the full int32 width, like real ones


# ------------------------------------------------------------------------------------ samples


def make_tables(n_segments: int, per_segment: int, prompt_len: int, response_len: int, seed: int = 0) -> list[pa.Table]:
    """Deterministic, realistic segments: groups of 8 sharing a prompt, random token ids,
    float32 logprobs, binary rewards. List columns are built from numpy offsets."""
    rng = np.random.default_rng(seed)
    return [_table(rng, s, per_segment, prompt_len, response_len) for s in range(n_segments)]


def _lists(lengths: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=type_))


def _table(rng: np.random.Generator, seg: int, n: int, prompt_len: int, response_len: int) -> pa.Table:
    groups = np.arange(n) // 8 + seg * ((n + 7) // 8)
    p_len = np.repeat(rng.integers(prompt_len * 3 // 4, prompt_len * 5 // 4 + 1, (n + 7) // 8), 8)[:n]
    r_len = rng.integers(response_len // 2, response_len * 3 // 2 + 1, n)
    # samples of one group share their prompt ids
    group_prompts = [rng.integers(0, VOCAB, p_len[i]) for i in range(0, n, 8)]
    prompt_ids = np.concatenate([group_prompts[i // 8] for i in range(n)])
    status = np.where(r_len >= response_len * 3 // 2, "truncated", "completed")
    columns = {
        "prompt": pa.array([f"question {g}: what is the sum of the numbers below?" for g in groups]),
        "prompt_ids": _lists(p_len, prompt_ids.astype(np.int32), pa.int32()),
        "response_ids": _lists(r_len, rng.integers(0, VOCAB, r_len.sum()).astype(np.int32), pa.int32()),
        "response": pa.array(["x" * int(k * 4) for k in r_len]),  # ~4 characters per token
        "label": pa.array([str(g % 100) for g in groups]),
        "reward": pa.array((rng.random(n) < 0.5).astype(np.float32)),
        "loss_mask": _lists(r_len, np.ones(r_len.sum(), np.int8), pa.int8()),
        "rollout_logprobs": _lists(r_len, -rng.exponential(1.0, r_len.sum()).astype(np.float32), pa.float32()),
        "span_starts": _lists(np.ones(n, int), np.zeros(n, np.int32), pa.int32()),
        "span_versions": _lists(np.ones(n, int), np.full(n, seg // 10, np.int32), pa.int32()),
        "submit_version": pa.array(np.full(n, seg // 10, np.int32)),
        "status": pa.array(status),
        "group_index": pa.array(groups.astype(np.int64)),
        "sample_index": pa.array((np.arange(n) % 8).astype(np.int32)),
        "prompt_index": pa.array(groups.astype(np.int64)),
        "adapter": pa.nulls(n, pa.string()),
        "error": pa.nulls(n, pa.string()),
        "metadata": pa.array(['{"source": "bench"}'] * n),
    }
    schema = arrow_schema()
    return pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema)


# ---------------------------------------------------------------------------------- measuring


@dataclass
class Throughput:
    samples: int
    nbytes: int
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def mib_per_s(self) -> float:
        return self.nbytes / MiB / self.seconds


def bench_stream_throughput(run_dir: str, opts: dict, tables: list[pa.Table], producer: str = "tput",
                            compression: str = "zstd") -> tuple[Throughput, Throughput, Throughput, list[bytes]]:
    """(synchronous append, write-behind writer, read) throughput of the stream, and the encoded
    segment bytes for the baseline."""
    stream = SampleStream(run_dir, producer=producer, storage_options=opts, compression=compression)
    n_samples = sum(t.num_rows for t in tables)
    SampleStream(run_dir, producer=f"warmup-{producer}", storage_options=opts, compression=compression).append(tables[0])  # imports, encoders
    stream.offsets()  # this object's own client and connection, set up outside the timing (as raw's)
    t0 = time.perf_counter()
    for table in tables:
        stream.append(table)
    write_s = time.perf_counter() - t0

    behind = SampleStream(run_dir, producer=f"{producer}-behind", storage_options=opts, compression=compression)
    behind.offsets()
    t0 = time.perf_counter()
    with behind.writer(max_pending=2) as writer:
        for table in tables:
            writer.append(table)
        writer.flush()  # timed until the last segment is visible
    behind_s = time.perf_counter() - t0

    read_stream = SampleStream(run_dir, producer=producer, storage_options=opts)
    read_stream.offsets()  # client and connection set up outside the timing
    reader = read_stream.reader("bench")
    t0 = time.perf_counter()
    segments = reader.read()
    read_s = time.perf_counter() - t0
    if sum(len(s) for s in segments) != n_samples:
        raise RuntimeError(f"reader saw {sum(len(s) for s in segments)} samples, expected {n_samples}")

    # the exact encoded bytes of each segment (plain fsspec reads, not timed)
    fs, _ = open_fs(run_dir, opts)
    payloads = [fs.cat_file(open_fs(s.uri, opts)[1]) for s in segments]
    nbytes = sum(len(p) for p in payloads)
    return (Throughput(n_samples, nbytes, write_s), Throughput(n_samples, nbytes, behind_s),
            Throughput(n_samples, nbytes, read_s), payloads)


def bench_raw_throughput(run_dir: str, opts: dict, payloads: list[bytes], per_segment: int, folder_name: str = "raw-tput") -> tuple[Throughput, Throughput]:
    fs, root = open_fs(run_dir, opts)
    folder = join(root, folder_name)
    if "file" in fs.protocol:
        fs.makedirs(folder, exist_ok=True)
    keys = [join(folder, f"{i:012d}.bin") for i in range(len(payloads))]
    nbytes = sum(len(p) for p in payloads)
    fs.pipe_file(join(folder, "warmup.bin"), payloads[0])  # connection set up, as for the stream
    fs.cat_file(join(folder, "warmup.bin"))
    t0 = time.perf_counter()
    for key, data in zip(keys, payloads):
        fs.pipe_file(key, data)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = sum(len(fs.cat_file(key)) for key in keys)
    read_s = time.perf_counter() - t0
    if got != nbytes:
        raise RuntimeError(f"raw read {got} bytes, wrote {nbytes}")
    n = len(payloads) * per_segment
    return Throughput(n, nbytes, write_s), Throughput(n, nbytes, read_s)


def bench_raw_durable_write(folder: str, payloads: list[bytes], per_segment: int) -> Throughput:
    """Local disk only: plain write + fsync of each payload, the durability the stream gives."""
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    for i, data in enumerate(payloads):
        with open(os.path.join(folder, f"{i:012d}.bin"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return Throughput(len(payloads) * per_segment, sum(len(p) for p in payloads), time.perf_counter() - t0)


def _paced(count: int, pace_s: float, put, starts: list[float]) -> None:
    """Call ``put(i)`` every ``pace_s`` seconds, recording each call's start time."""
    next_at = time.perf_counter()
    for i in range(count):
        delay = next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        starts[i] = time.perf_counter()
        put(i)
        next_at += pace_s


def _latencies(starts: list[float], seen: list[float]) -> list[float]:
    missing = [i for i, t in enumerate(seen) if t != t]
    if missing:
        raise RuntimeError(f"the polling reader never saw segments {missing[:5]}")
    return [(s - a) * 1000 for a, s in zip(starts, seen)]


def bench_stream_latency(run_dir: str, opts: dict, tables: list[pa.Table], pace_s: float, poll_s: float,
                         compression: str = "zstd") -> list[float]:
    count = len(tables)
    starts, seen = [float("nan")] * count, [float("nan")] * count
    producer = SampleStream(run_dir, producer="latency", storage_options=opts, compression=compression)
    reader = SampleStream(run_dir, producer="latency", storage_options=opts).reader("poller")
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for segment in reader.read():
                seen[segment.offset] = time.perf_counter()
            if reader.position >= count - 1:
                return
            time.sleep(poll_s)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    _paced(count, pace_s, lambda i: producer.append(tables[i]), starts)
    thread.join(timeout=30)
    stop.set()
    return _latencies(starts, seen)


def bench_raw_latency(run_dir: str, opts: dict, payloads: list[bytes], pace_s: float, poll_s: float) -> list[float]:
    fs, root = open_fs(run_dir, opts)
    poll_fs, _ = open_fs(run_dir, opts)  # its own client, as a separate consumer would have
    folder = join(root, "raw-latency")
    if "file" in fs.protocol:
        fs.makedirs(folder, exist_ok=True)
    keys = [join(folder, f"{i:012d}.bin") for i in range(len(payloads))]
    count = len(payloads)
    starts, seen = [float("nan")] * count, [float("nan")] * count
    stop = threading.Event()

    def poll() -> None:
        i = 0
        while i < count and not stop.is_set():
            # one GET per poll: s3fs's exists() on a missing key also lists the parent prefix,
            # which made the baseline ~4x slower than the stream in a first version
            try:
                poll_fs.cat_file(keys[i])
            except FileNotFoundError:
                time.sleep(poll_s)
                continue
            seen[i] = time.perf_counter()
            i += 1

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    _paced(count, pace_s, lambda i: fs.pipe_file(keys[i], payloads[i]), starts)
    thread.join(timeout=30)
    stop.set()
    return _latencies(starts, seen)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


# ------------------------------------------------------------------------------------- report


def bench_backend(name: str, run_dir: str, opts: dict, args: argparse.Namespace, tables: list[pa.Table],
                  compression: str = "zstd") -> list[tuple]:
    print(f"[{name}] throughput: {len(tables)} segments x {args.samples_per_segment} samples", file=sys.stderr)
    # best of --repeats passes (the machine is shared; the best pass is the least disturbed one)
    best: dict[str, Throughput] = {}
    local = run_dir.startswith("file://")
    # warm both paths; pass 0 (stream first) then replaces these with the encoded bytes of every segment
    payloads_all = bench_stream_throughput(run_dir, opts, tables[:2], "warmup-tput", compression)[-1]
    bench_raw_throughput(run_dir, opts, payloads_all, args.samples_per_segment, "raw-warmup")
    for rep in range(args.repeats):
        # alternate which side goes first: a local endpoint's speed drifts as it stores more objects
        raw_first = rep % 2 == 1
        if raw_first:
            r_write, r_read = bench_raw_throughput(run_dir, opts, payloads_all, args.samples_per_segment, f"raw-tput-{rep}")
        s_write, s_behind, s_read, payloads_all = bench_stream_throughput(run_dir, opts, tables, f"tput-{rep}", compression)
        if not raw_first:
            r_write, r_read = bench_raw_throughput(run_dir, opts, payloads_all, args.samples_per_segment, f"raw-tput-{rep}")
        passes = [("sw", s_write), ("sb", s_behind), ("sr", s_read), ("rw", r_write), ("rr", r_read)]
        if local:
            folder = os.path.join(run_dir.removeprefix("file://"), f"raw-durable-{rep}")
            passes.append(("rd", bench_raw_durable_write(folder, payloads_all, args.samples_per_segment)))
        for key, t in passes:
            if key not in best or t.seconds < best[key].seconds:
                best[key] = t
    s_write, s_behind, s_read, r_write, r_read = best["sw"], best["sb"], best["sr"], best["rw"], best["rr"]
    n_lat = min(args.latency_segments, len(tables))
    print(f"[{name}] latency: {n_lat} appends, one every {args.pace_ms} ms", file=sys.stderr)
    s_lat = bench_stream_latency(run_dir, opts, tables[:n_lat], args.pace_ms / 1000, args.poll_ms / 1000, compression)
    r_lat = bench_raw_latency(run_dir, opts, payloads_all[:n_lat], args.pace_ms / 1000, args.poll_ms / 1000)
    rows = [
        (name, "write samples/s, append (higher better)", s_write.samples_per_s, r_write.samples_per_s),
        (name, "write MiB/s, append (higher better)", s_write.mib_per_s, r_write.mib_per_s),
        (name, "write MiB/s, write-behind writer (higher better)", s_behind.mib_per_s, r_write.mib_per_s),
    ]
    if local:
        rows.append((name, "write MiB/s, writer vs raw write+fsync (higher better)", s_behind.mib_per_s, best["rd"].mib_per_s))
    return rows + [
        (name, "read samples/s (higher better)", s_read.samples_per_s, r_read.samples_per_s),
        (name, "read MiB/s (higher better)", s_read.mib_per_s, r_read.mib_per_s),
        (name, "end-to-end p50 ms (lower better)", percentile(s_lat, 50), percentile(r_lat, 50)),
        (name, "end-to-end p95 ms (lower better)", percentile(s_lat, 95), percentile(r_lat, 95)),
    ]


def render(rows: list[tuple], args: argparse.Namespace, segment_bytes: float) -> str:
    lines = [
        f"SampleStream vs raw fsspec: {args.segments} segments x {args.samples_per_segment} samples "
        f"(prompt ~{args.prompt_len}, response ~{args.response_len} tokens; ~{segment_bytes / 1024:.0f} KiB "
        f"per encoded segment); latency: {args.latency_segments} appends every {args.pace_ms} ms, "
        f"reader polls every {args.poll_ms} ms; throughput is the best of {args.repeats} passes. "
        "memory:// isolates the stream's own cost (Arrow IPC + zstd encode/decode, listing): "
        "raw memory pipe/cat is a dict store.",
        "",
        "| backend | metric | miles stream | raw fsspec | ratio (stream/raw) |",
        "|---|---|---:|---:|---:|",
    ]
    for backend, metric, stream, raw in rows:
        lines.append(f"| {backend} | {metric} | {stream:,.1f} | {raw:,.1f} | {stream / raw:.2f} |")
    lines += ["", "Goals (from the issue; memory:// has none, it shows the stream's own CPU cost):"]
    for backend, metric, stream, raw in rows:
        goal_row = "read" in metric or "writer" in metric  # the producer writes through the writer
        if "MiB/s" in metric and goal_row and backend != "memory":  # memory:// only isolates the codec cost
            ok = stream / raw >= 0.85
            lines.append(f"- {backend} {metric.split(' (')[0]}: stream within 15% of raw (ratio >= 0.85): "
                         f"{'MET' if ok else 'NOT MET'} ({stream / raw:.2f})")
    for backend, metric, stream, _ in rows:
        if backend == "s3" and metric.startswith("end-to-end p50"):
            lines.append(f"- s3 (local moto) end-to-end p50 < 100 ms: {'MET' if stream < 100 else 'NOT MET'} ({stream:.1f} ms)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples-per-segment", type=int, default=64)
    parser.add_argument("--segments", type=int, default=60, help="segments for the throughput runs")
    parser.add_argument("--latency-segments", type=int, default=40, help="paced appends for the latency runs")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--pace-ms", type=float, default=50.0)
    parser.add_argument("--poll-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3, help="throughput passes; the best is reported")
    parser.add_argument("--backends", default="memory,file,file-lz4,file-none,s3",
                        help="comma-separated: memory (codec cost alone), file, file-lz4, file-none "
                             "(local disk with the lz4 codec or none), s3")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "stream.md"))
    args = parser.parse_args(argv)

    tables = make_tables(max(args.segments, args.latency_segments), args.samples_per_segment,
                         args.prompt_len, args.response_len)
    rows: list[tuple] = []
    backends = args.backends.split(",")
    if "memory" in backends:
        rows += bench_backend("memory", f"memory://bench-stream-{os.getpid()}/run", {}, args, tables[: args.segments])
    for backend in ("file", "file-lz4", "file-none"):  # file-<codec>: the same with another segment codec
        if backend in backends:
            with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
                codec = backend.partition("-")[2] or "zstd"
                rows += bench_backend(backend, f"file://{tmp}/run", {}, args, tables[: args.segments], codec)
    if "s3" in backends:
        with LocalS3() as s3:
            bucket = s3.make_bucket("bench-stream")
            rows += bench_backend("s3", f"{bucket}/run", s3.storage_options, args, tables[: args.segments])

    # encoded size per segment, for the header (same encoder as the stream: re-read from a memory stream)
    probe = SampleStream("memory://bench-stream-probe/run", producer="probe")
    probe.append(tables[0])
    fs, _ = open_fs(probe.segment_uri(0))
    segment_bytes = fs.size(open_fs(probe.segment_uri(0))[1])

    text = render(rows, args, segment_bytes)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(f"Command: `{' '.join(['.venv/bin/python bench/stream.py', *(argv if argv is not None else sys.argv[1:])])}`\n\n")
        f.write(text)


if __name__ == "__main__":
    main()
