"""The storage contract: SampleStream, StreamReader, WeightStore and RunLayout behaviour that every
backend (memory://, file://, plain paths, s3://) must show.

Subclass ``StorageContract`` in a test module that defines two fixtures: ``root`` (a fresh storage
root URL per test) and ``storage_options`` (what to pass to the classes; None for local/memory).
"""

from __future__ import annotations

import re
import time

import pyarrow as pa
import pytest

from miles_core.storage import RunLayout, SampleStream, WeightStore, atomic_write, join, load_snapshot, open_fs
from miles_core.storage.stream import _encode, segment_name
from miles_core.types import Group, Sample, SampleStatus, samples_to_table

def make_samples(n: int, group_index: int = 0) -> list[Sample]:
    statuses = list(SampleStatus)
    return [
        Sample(
            prompt=f"{group_index}+{i}=",
            prompt_ids=[1, 2, group_index, i],
            response_ids=[5, 6, 7],
            response="567",
            label=None if i % 2 else str(group_index + i),
            reward=None if i == 1 else 0.1 * i,
            loss_mask=[1, 0, 1],
            rollout_logprobs=[-0.1, -1.3, -2.7],
            span_starts=[0, 2],
            span_versions=[3, 4],
            submit_version=3,
            status=statuses[i % len(statuses)],
            group_index=group_index,
            sample_index=i,
            prompt_index=100 + group_index,
            adapter="lora-a" if i % 2 else None,
            error="boom" if statuses[i % len(statuses)] is SampleStatus.FAILED else None,
            metadata={"source": "toy", "nested": {"k": [1, 2]}, "i": i},
        )
        for i in range(n)
    ]

def assert_same_samples(got: list[Sample], want: list[Sample]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        # float columns are float32 in Arrow: compare those approximately, everything else exactly
        assert g.rollout_logprobs == pytest.approx(w.rollout_logprobs, rel=1e-6)
        assert g.reward == (None if w.reward is None else pytest.approx(w.reward, rel=1e-6))
        exact = {k: v for k, v in vars(w).items() if k not in ("rollout_logprobs", "reward")}
        assert {k: getattr(g, k) for k in exact} == exact
        assert isinstance(g.status, SampleStatus)

def write_raw(stream: SampleStream, name: str, data: bytes) -> None:
    """Put bytes at a name in the producer folder directly, the way another writer would."""
    stream.fs.makedirs(stream.path, exist_ok=True)
    stream.fs.pipe_file(join(stream.path, name), data)


def _empty_dir(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    return empty


def state_dict(scale: float):
    import torch

    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale, "b": torch.ones(3, dtype=torch.bfloat16)}

def assert_same_tensors(got, want):
    import torch

    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])


class StorageContract:
    """Every test takes ``root``; ``self.so`` is the ``storage_options`` fixture."""

    so: dict | None = None

    @pytest.fixture(autouse=True)
    def _bind_storage_options(self, storage_options):
        self.so = storage_options

    # ----------------------------------------------------------------------------------- streams

    def test_round_trip_preserves_every_field(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        want = make_samples(5)
        assert stream.append(want) == 0
        (segment,) = stream.reader("trainer").read()
        assert segment.offset == 0 and len(segment) == 5
        assert_same_samples(segment.samples(), want)

    def test_append_accepts_groups_and_tables(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        groups = [Group(make_samples(2, g)) for g in range(3)]
        assert stream.append(groups) == 0
        assert stream.append(samples_to_table(make_samples(3, 7))) == 1
        first, second = stream.read()
        assert [s.group_index for s in first.samples()] == [0, 0, 1, 1, 2, 2]
        assert_same_samples(second.samples(), make_samples(3, 7))

    def test_append_rejects_bad_input(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        with pytest.raises(ValueError, match="no samples"):
            stream.append([])
        with pytest.raises(TypeError, match="dict"):
            stream.append([{"prompt": "x"}])
        wrong = samples_to_table(make_samples(1)).drop_columns(["metadata"])
        with pytest.raises(ValueError, match="columns differ"):
            stream.append(wrong)
        assert stream.offsets() == []

    def test_segments_come_in_order_and_in_batches(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        for g in range(5):
            assert stream.append(make_samples(2, g)) == g
        reader = stream.reader("trainer")
        batch = reader.read(max_segments=2)
        assert [s.offset for s in batch] == [0, 1]
        assert [s.offset for s in reader.read()] == [2, 3, 4]
        assert reader.read() == []
        assert [s.samples()[0].group_index for s in stream.read(after=2)] == [3, 4]
        assert stream.read_segment(3).samples()[0].group_index == 3

    def test_offsets_past_ten_sort_numerically(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        for g in range(12):
            stream.append(make_samples(1, g))
        assert stream.offsets(after=8) == [9, 10, 11]

    def test_readers_have_independent_cursors(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        for g in range(3):
            stream.append(make_samples(1, g))
        trainer, evaluator = stream.reader("trainer"), stream.reader("eval")
        trainer.commit(trainer.read()[-1].offset)
        assert (trainer.cursor, evaluator.cursor) == (2, -1)
        assert [s.offset for s in evaluator.read(max_segments=1)] == [0]
        evaluator.commit(0)
        assert stream.reader("eval").cursor == 0
        assert stream.reader("trainer").cursor == 2

    def test_cursor_survives_restart(self, root):
        run = join(root, "run")
        stream = SampleStream(run, storage_options=self.so)
        for g in range(4):
            stream.append(make_samples(1, g))
        reader = stream.reader("trainer")
        segments = reader.read(max_segments=3)
        reader.commit(segments[1].offset)  # crash after training on two of the three segments

        resumed = SampleStream(run, storage_options=self.so).reader("trainer")
        assert resumed.cursor == 1
        assert [s.offset for s in resumed.read()] == [2, 3]

    def test_producer_restart_continues_offsets(self, root):
        run = join(root, "run")
        SampleStream(run, storage_options=self.so).append(make_samples(1, 0))
        SampleStream(run, storage_options=self.so).append(make_samples(1, 1))
        assert SampleStream(run, storage_options=self.so).append(make_samples(1, 2)) == 2
        assert SampleStream(run, storage_options=self.so).offsets() == [0, 1, 2]

    def test_partial_write_of_a_crashed_writer_is_ignored(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        stream.append(make_samples(1))
        whole = _encode(samples_to_table(make_samples(2)))
        write_raw(stream, f".{segment_name(1)}.tmp-dead", whole[: len(whole) // 2])
        write_raw(stream, "000000000001.arrow.tmp", whole)
        write_raw(stream, "notes.txt", b"x")
        assert stream.offsets() == [0]
        assert [s.offset for s in stream.reader("trainer").read()] == [0]
        assert stream.append(make_samples(1)) == 1

    def test_truncated_segment_is_a_clear_error(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        whole = _encode(samples_to_table(make_samples(3)))
        write_raw(stream, segment_name(0), whole[: len(whole) // 2])
        with pytest.raises(ValueError, match=re.escape(stream.segment_uri(0))):
            stream.reader("trainer").read()
        # cut exactly after the last record batch: pyarrow alone would read it without complaint
        write_raw(stream, segment_name(0), whole[:-8])
        assert pa.ipc.open_stream(whole[:-8]).read_all().num_rows == 3
        with pytest.raises(ValueError, match=f"{re.escape(stream.segment_uri(0))} is truncated"):
            stream.read_segment(0)

    def test_unknown_schema_version_is_a_clear_error(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        table = samples_to_table(make_samples(1))
        future = table.replace_schema_metadata({"miles.schema_version": "99"})
        write_raw(stream, segment_name(0), _encode(future))
        with pytest.raises(ValueError, match=f"{re.escape(stream.segment_uri(0))} has schema version '99'"):
            stream.read_segment(0)
        with pytest.raises(ValueError, match="schema version '99'"):
            stream.append(future)

    def test_missing_segment_names_the_uri(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        with pytest.raises(FileNotFoundError, match=re.escape(stream.segment_uri(4))):
            stream.read_segment(4)

    def test_end_of_stream(self, root):
        run = join(root, "run")
        stream = SampleStream(run, storage_options=self.so)
        reader = stream.reader("trainer")
        stream.append(make_samples(1, 0))
        stream.append(make_samples(1, 1))
        assert not reader.finished
        assert stream.close() == 1
        assert stream.close() == 1  # idempotent
        assert not reader.finished  # closed, but not all read yet
        assert [s.offset for s in reader.wait(timeout=1.0)] == [0, 1]
        assert reader.finished
        assert reader.wait(timeout=5.0) == []  # returns at once: nothing more will come
        with pytest.raises(RuntimeError, match="closed"):
            stream.append(make_samples(1))
        with pytest.raises(RuntimeError, match="closed"):
            SampleStream(run, storage_options=self.so).append(make_samples(1))

    def test_empty_closed_stream_is_finished(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        assert stream.close() == -1
        assert stream.reader("trainer").finished

    def test_wait_times_out_empty(self, root):
        reader = SampleStream(join(root, "run"), storage_options=self.so).reader("trainer")
        assert reader.wait(timeout=0.05, poll=0.01) == []
        assert not reader.finished

    def test_segments_are_plain_arrow(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        stream.append(make_samples(4))
        fs, path = open_fs(stream.segment_uri(0), self.so)
        table = pa.ipc.open_stream(fs.cat_file(path)).read_all()
        assert table.num_rows == 4
        assert table.column("prompt").to_pylist() == [s.prompt for s in make_samples(4)]

    def test_bad_names_are_rejected(self, root):
        with pytest.raises(ValueError, match="invalid producer name"):
            SampleStream(join(root, "run"), storage_options=self.so, producer="a/b")
        with pytest.raises(ValueError, match="invalid reader name"):
            SampleStream(join(root, "run"), storage_options=self.so).reader(".hidden")

    @pytest.mark.parametrize("compression", ["zstd", "lz4", "none"])
    def test_every_compression_round_trips_and_any_reader_decodes_it(self, root, compression):
        stream = SampleStream(join(root, "run"), storage_options=self.so, compression=compression)
        stream.append(make_samples(3, 1))
        (segment,) = SampleStream(join(root, "run"), storage_options=self.so).read()  # reader's default differs
        assert_same_samples(segment.samples(), make_samples(3, 1))
        stored = stream.fs.cat_file(join(stream.path, segment_name(0)))
        assert stored == _encode(samples_to_table(make_samples(3, 1)), compression)  # written with that codec
        with pytest.raises(ValueError, match="one of"):
            SampleStream(join(root, "run"), storage_options=self.so, compression="gzip")

    def test_writer_writes_behind_in_order(self, root):
        stream = SampleStream(join(root, "run"), storage_options=self.so)
        stream.append(make_samples(1, 0))  # a writer continues after what is there
        with stream.writer(max_pending=2) as writer:
            assert [writer.append(make_samples(2, g)) for g in range(1, 6)] == [1, 2, 3, 4, 5]
            writer.flush()
            assert writer.pending == 0
            assert stream.offsets() == [0, 1, 2, 3, 4, 5]
        assert [s.samples()[0].group_index for s in stream.read()] == [0, 1, 2, 3, 4, 5]
        assert_same_samples(stream.read_segment(3).samples(), make_samples(2, 3))

    def test_writer_blocks_when_max_pending_segments_wait(self, root):
        import threading

        stream = SampleStream(join(root, "run"), storage_options=self.so)
        gate, real_write = threading.Event(), stream._write_segment
        stream._write_segment = lambda offset, table: (gate.wait(10), real_write(offset, table))
        writer = stream.writer(max_pending=2)
        for g in range(3):  # one being written (held at the gate), two queued
            writer.append(make_samples(1, g))
        fourth = threading.Thread(target=writer.append, args=(make_samples(1, 3),))
        fourth.start()
        fourth.join(0.3)
        assert fourth.is_alive(), "append must block while max_pending segments wait"
        assert stream.offsets() == []
        gate.set()
        fourth.join(10)
        writer.close(end_stream=True)
        assert stream.offsets() == [0, 1, 2, 3] and stream.end_offset() == 3

    def test_writer_failure_stops_later_segments_and_names_them(self, root):
        from miles_core.storage import StreamWriteError

        import threading

        stream = SampleStream(join(root, "run"), storage_options=self.so)
        real_write, all_queued = stream._write_segment, threading.Event()

        def flaky(offset, table):
            if offset == 1:
                all_queued.wait(10)  # fail once every append is in, so that none of them raises
                raise OSError("disk on fire")
            real_write(offset, table)

        stream._write_segment = flaky
        writer = stream.writer(max_pending=4)
        for g in range(4):
            writer.append(make_samples(1, g))
        all_queued.set()
        with pytest.raises(StreamWriteError, match=r"000000000001\.arrow.*disk on fire.*\[1, 2, 3\]") as err:
            writer.flush()
        assert err.value.lost == [1, 2, 3]
        assert stream.offsets() == [0], "nothing after the failed segment may become visible"
        with pytest.raises(StreamWriteError):
            writer.append(make_samples(1, 9))
        with pytest.raises(StreamWriteError):
            writer.close(end_stream=True)
        assert stream.end_offset() is None

    # ----------------------------------------------------------------------------------- weights

    def test_weights_publish_load_latest_versions(self, root):
        store = WeightStore(join(root, "weights"), storage_options=self.so)
        assert store.latest() is None and store.versions() == []
        uri = store.publish(0, state_dict(1.0), metadata={"step": "0"})
        assert uri == store.uri(0)
        store.publish(2, state_dict(2.0))
        assert store.latest() == 2 and store.versions() == [0, 2]
        assert_same_tensors(store.load(0), state_dict(1.0))
        assert_same_tensors(store.load(), state_dict(2.0))
        assert_same_tensors(load_snapshot(uri, self.so), state_dict(1.0))
        assert store.metadata(0)["step"] == "0" and store.metadata(0)["miles.version"] == "0"
        store.publish(1, state_dict(3.0))  # out of order: LATEST does not go back
        assert store.latest() == 2 and store.versions() == [0, 1, 2]

    def test_weights_uri_form(self, root):
        uri = WeightStore(join(root, "weights"), storage_options=self.so).uri(7)
        assert uri.endswith("/weights/v000007")
        if root.startswith(("memory://", "s3://")):
            assert uri.startswith(root.split("://")[0] + "://")
        else:
            assert uri.startswith("/")

    def test_weights_double_publish_raises(self, root):
        store = WeightStore(join(root, "weights"), storage_options=self.so)
        store.publish(1, state_dict(1.0))
        with pytest.raises(FileExistsError, match=re.escape(store.uri(1))):
            store.publish(1, state_dict(2.0))
        assert_same_tensors(store.load(1), state_dict(1.0))

    def test_weights_folder_publish_and_download(self, root, tmp_path):
        """An adapter-style folder (config + safetensors) round-trips byte for byte."""
        src = tmp_path / "adapter"
        src.mkdir()
        (src / "adapter_config.json").write_text('{"r": 8}')
        (src / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4)
        (src / ".hidden").write_text("not published")
        store = WeightStore(join(root, "adapters"), storage_options=self.so)
        assert store.publish_folder(3, src) == store.uri(3)
        assert store.latest() == 3 and store.versions() == [3]
        out = store.download(None, tmp_path / "back")
        assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert (out / "adapter_model.safetensors").read_bytes() == (src / "adapter_model.safetensors").read_bytes()
        with pytest.raises(FileExistsError, match=re.escape(store.uri(3))):
            store.publish_folder(3, src)
        with pytest.raises(ValueError, match="no files"):
            store.publish_folder(4, _empty_dir(tmp_path))

    def test_weights_missing_version_names_uri_and_available(self, root):
        store = WeightStore(join(root, "weights"), storage_options=self.so)
        with pytest.raises(FileNotFoundError, match="no weights published"):
            store.load()
        store.publish(0, state_dict(1.0))
        store.publish(3, state_dict(1.0))
        with pytest.raises(FileNotFoundError, match=re.escape(store.uri(5)) + r".*available versions: \[0, 3\]"):
            store.load(5)

    def test_weights_uncommitted_version_is_invisible(self, root):
        store = WeightStore(join(root, "weights"), storage_options=self.so)
        store.publish(0, state_dict(1.0))
        atomic_write(store.fs, join(store.path, "v000001", "model.safetensors"), b"half a crash")
        assert store.versions() == [0] and store.latest() == 0
        with pytest.raises(FileNotFoundError, match="not committed"):
            store.load(1)
        store.publish(1, state_dict(2.0))  # the crashed version can be published again
        assert_same_tensors(store.load(1), state_dict(2.0))

    def test_weights_tied_tensors_are_saved(self, root):
        import torch

        embed = torch.randn(4, 2)
        store = WeightStore(join(root, "weights"), storage_options=self.so)
        store.publish(0, {"embed.weight": embed, "lm_head.weight": embed, "view": embed[1:]})
        loaded = store.load(0)
        assert torch.equal(loaded["lm_head.weight"], embed) and torch.equal(loaded["view"], embed[1:])

    def test_weights_wait_for(self, root):
        store = WeightStore(join(root, "weights"), storage_options=self.so)
        store.publish(0, state_dict(1.0))
        assert store.wait_for(0, timeout=1.0) == store.uri(0)
        with pytest.raises(TimeoutError, match=re.escape(store.uri(1))):
            store.wait_for(1, timeout=0.05, poll=0.01)

    def test_weights_reject_bad_input(self, root):
        store = WeightStore(join(root, "weights"), storage_options=self.so)
        with pytest.raises(ValueError, match="version must be an int"):
            store.publish(-1, state_dict(1.0))
        with pytest.raises(TypeError, match="not a torch.Tensor"):
            store.publish(0, {"w": [1.0]})
        with pytest.raises(TypeError, match="metadata must map str to str"):
            store.publish(0, state_dict(1.0), metadata={"step": 1})
        assert store.versions() == []

    # ------------------------------------------------------------------------------------ layout

    def test_run_layout_paths(self, root):
        layout = RunLayout(root, "toy", "20261130-141502-ab12", self.so)
        run = layout.run_dir
        assert run.endswith("/toy/20261130-141502-ab12")
        assert layout.config == f"{run}/config.json"
        assert layout.samples() == f"{run}/samples/rollout"
        assert layout.cursor("trainer") == f"{run}/cursors/rollout/trainer.json"
        assert layout.weights == f"{run}/weights"
        assert (layout.metrics, layout.eval, layout.summary) == (
            f"{run}/metrics.jsonl",
            f"{run}/eval.jsonl",
            f"{run}/summary.json",
        )
        # the stream and store built from the layout's URLs write where the layout says
        stream = SampleStream(run, storage_options=self.so)
        stream.append(make_samples(1))
        stream.reader("trainer").commit(0)
        fs, _ = open_fs(run, self.so)
        assert fs.exists(open_fs(layout.cursor("trainer"), self.so)[1])
        assert stream.uri == layout.samples()
        assert WeightStore(layout.weights, storage_options=self.so).uri(1) == f"{run}/weights/v000001"

    # ------------------------------------------------------------- create-only, concurrency, retention

    def test_second_producer_with_same_id_cannot_clobber(self, root):
        run = join(root, "run")
        first, second = SampleStream(run, storage_options=self.so), SampleStream(run, storage_options=self.so)
        assert first.append(make_samples(1, 0)) == 0
        second._next_offset = 0  # both started before either wrote: they claim the same offset
        with pytest.raises(FileExistsError, match=re.escape(first.segment_uri(0)) + ".*another producer"):
            second.append(make_samples(2, 9))
        assert [s.group_index for s in first.read_segment(0).samples()] == [0]

    def test_two_producers_two_readers_concurrently(self, root):
        import threading

        run, n = join(root, "run"), 12
        got: dict[tuple[str, str], list[int]] = {}
        errors: list[BaseException] = []

        def produce(producer: str) -> None:
            stream = SampleStream(run, producer=producer, storage_options=self.so)
            for g in range(n):
                stream.append(make_samples(1, g))
            stream.close()

        def consume(reader_name: str, producer: str) -> None:
            reader = SampleStream(run, producer=producer, storage_options=self.so).reader(reader_name)
            seen = got.setdefault((reader_name, producer), [])
            deadline = time.monotonic() + 60
            while not reader.finished and time.monotonic() < deadline:
                segments = reader.wait(timeout=1.0, poll=0.01, max_segments=3)
                seen.extend(s.samples()[0].group_index for s in segments)
                if len(seen) == 5 and segments:  # crash and restart: resume from the durable cursor
                    reader.commit(segments[-1].offset)
                    reader = SampleStream(run, producer=producer, storage_options=self.so).reader(reader_name)
                elif segments:
                    reader.commit(segments[-1].offset)

        def guard(fn, *args):
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=guard, args=(produce, p)) for p in ("p1", "p2")]
        threads += [threading.Thread(target=guard, args=(consume, r, p)) for r in ("r1", "r2") for p in ("p1", "p2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert got == {(r, p): list(range(n)) for r in ("r1", "r2") for p in ("p1", "p2")}

    def test_weights_latest_never_moves_backwards_under_concurrent_publishers(self, root):
        import threading

        store = WeightStore(join(root, "weights"), storage_options=self.so)
        errors: list[BaseException] = []

        def publish(versions):
            try:
                for v in versions:
                    WeightStore(join(root, "weights"), storage_options=self.so).publish(v, state_dict(float(v)))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=publish, args=(range(k, 10, 2),)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert store.versions() == list(range(10)) and store.latest() == 9
        assert store._read_latest_hint() == 9

    def test_weights_retention_keeps_latest_and_pins(self, root):
        store = WeightStore(join(root, "weights"), storage_options=self.so)
        for v in range(6):
            store.publish(v, state_dict(float(v)))
        store.pin(1, "eval")
        store.pin(1, "rollout")
        store.pin(3, "rollout")
        assert store.pins() == {1: {"eval", "rollout"}, 3: {"rollout"}}
        with pytest.raises(ValueError, match="keep_last"):
            store.retain(0)
        assert store.retain(keep_last=2, pinned={0}) == [2]
        assert store.versions() == [0, 1, 3, 4, 5]
        store.unpin(3, "rollout")
        store.unpin(3, "rollout")  # idempotent
        store.unpin(1, "eval")
        assert store.retain(keep_last=1) == [0, 3, 4]
        assert store.versions() == [1, 5] and store.latest() == 5
        assert_same_tensors(store.load(1), state_dict(1.0))
        with pytest.raises(FileNotFoundError, match="not committed"):
            store.load(3)
