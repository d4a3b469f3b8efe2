"""Storage over memory://, file:// and plain paths: the shared contract plus local-only tests.
The same contract runs against s3:// (moto) in tests/integration/test_storage_s3.py."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import pytest

from contract.storage_contract import StorageContract, assert_same_tensors, make_samples, state_dict
from miles_core.storage import RunLayout, SampleStream, WeightStore, new_run_id
from miles_core.storage.fs import (
    RetryingFS,
    RetryPolicy,
    StorageUnavailableError,
    atomic_write,
    is_transient,
    join,
    list_names,
)
from miles_core.storage.layout import CHECKPOINT_STATE, TRAINER_STATE, checkpoint_dir


@pytest.fixture(params=["memory", "file", "path"])
def root(request, tmp_path) -> str:
    """A fresh storage root: a unique memory:// folder, a file:// URL, or a plain local path."""
    if request.param == "memory":
        return f"memory://test-storage-{uuid.uuid4().hex}"
    if request.param == "file":
        return f"file://{tmp_path}"
    return str(tmp_path)


@pytest.fixture
def storage_options():
    return None


class TestLocalStorage(StorageContract):
    pass


def test_retries_are_bounded_and_skip_permanent_errors(tmp_path):
    fs = SampleStream(str(tmp_path)).fs
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    policy = RetryPolicy(attempts=4, initial_delay=0.001, deadline=5)
    assert RetryingFS(fs, policy).call(flaky, "obj") == "ok" and len(calls) == 3
    def down():
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(StorageUnavailableError, match="obj: storage endpoint .* after 4 attempt"):
        RetryingFS(fs, RetryPolicy(attempts=4, initial_delay=0.001)).call(down, "obj")
    for permanent in (FileExistsError("x"), FileNotFoundError("x"), ValueError("corrupt")):
        assert not is_transient(permanent)
        with pytest.raises(type(permanent)):
            RetryingFS(fs, policy).call(lambda: (_ for _ in ()).throw(permanent), "obj")


def test_local_atomic_write_leaves_no_temp_files(tmp_path):
    stream = SampleStream(str(tmp_path))
    stream.append(make_samples(2))
    stream.reader("r").commit(0)
    names = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert names == ["000000000000.arrow", "r.json"]



def test_new_run_id_sorts_by_time():
    run_id = new_run_id()
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", run_id)
    assert new_run_id() != run_id
    with pytest.raises(ValueError, match="invalid run name"):
        RunLayout("memory://x", "../escape", run_id)



def _checkpoint(layout: RunLayout, step: int, complete: bool = True) -> None:
    """A checkpoint folder as ``RunSession.save_checkpoint`` leaves it (or a save cut short)."""
    atomic_write(layout.fs, join(layout.path, checkpoint_dir(step), TRAINER_STATE), b"trainer state")
    if complete:
        layout.write_json(f"{checkpoint_dir(step)}/{CHECKPOINT_STATE}", {"step": step})


def test_checkpoints_list_complete_ones_and_retention_keeps_the_newest(root):
    layout = RunLayout(root, "toy", "run1")
    assert layout.checkpoints() == [] and layout.latest_checkpoint() is None and layout.prune_checkpoints(2) == []
    assert layout.checkpoint(3, TRAINER_STATE) == f"{layout.run_dir}/checkpoints/step-000003/trainer.pt"
    for step, complete in [(2, False), (3, True), (6, True), (9, False), (12, True), (15, False)]:
        _checkpoint(layout, step, complete)
    # 2, 9, 15 have no state.json: saves that did not finish, never resumed from
    assert layout.checkpoints() == [3, 6, 12] and layout.latest_checkpoint() == 12
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        layout.prune_checkpoints(0)
    # keep 6 and 12; 3 is beyond keep, 2 and 9 are leftovers older than 12; 15 may be a save under way
    assert layout.prune_checkpoints(2) == [2, 3, 9]
    left = sorted(list_names(layout.fs, join(layout.path, "checkpoints")))
    assert left == ["step-000006", "step-000012", "step-000015"]
    assert layout.prune_checkpoints(1) == [6] and layout.checkpoints() == [12]
    assert layout.prune_checkpoints(1) == [] and layout.latest_checkpoint() == 12  # never the newest


def test_jsonl_round_trip(root):
    layout = RunLayout(root, "toy", "run1")
    assert layout.read_jsonl("metrics.jsonl") == []
    layout.write_jsonl("metrics.jsonl", [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}])
    assert layout.read_jsonl("metrics.jsonl") == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]


def test_weights_rollback_moves_latest_back_and_deletes_newer_versions(root):
    store = WeightStore(join(root, "weights"))
    for v in (2, 4, 6, 8):
        store.publish(v, state_dict(float(v)))
    assert store.rollback(4) == [8, 6]
    assert store.versions() == [2, 4] and store.latest() == 4 and store._read_latest_hint() == 4
    store.publish(6, state_dict(60.0))  # the redone step publishes its version number again
    assert store.latest() == 6
    assert_same_tensors(store.load(), state_dict(60.0))
    assert store.rollback(6) == []  # nothing newer: a no-op

    with pytest.raises(ValueError, match="version 5.*not committed.*available versions: \\[2, 4, 6\\]"):
        store.rollback(5)
    store.pin(6, "eval")
    with pytest.raises(ValueError, match="newer versions are pinned"):
        store.rollback(4)
    assert store.versions() == [2, 4, 6] and store.latest() == 6  # refused before touching anything
    store.unpin(6, "eval")

    store._move_latest_back(4)  # a rollback cut short after moving LATEST: readers already see 4
    assert store.latest() == 4
    assert store.rollback(4) == [6] and store.versions() == [2, 4]

    assert store.rollback(0) == [4, 2]  # back to the starting model: nothing published
    assert store.versions() == [] and store.latest() is None and store._read_latest_hint() is None
    store.publish(1, state_dict(1.0))
    assert store.latest() == 1


def test_storage_imports_without_torch_or_pyarrow():
    code = "import sys, miles_core.storage; print(sorted({'torch', 'pyarrow'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_snapshots_in_the_configured_dtype_with_a_tied_head_stored_once(root):
    import torch

    embed = torch.randn(10, 4)
    tied = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "steps": torch.tensor([3])}
    plain = WeightStore(join(root, "plain"))
    plain.publish(1, tied)
    got = plain.load(1)
    assert set(got) == set(tied) and got["lm_head.weight"].dtype == torch.float32  # a server engine's copy
    lean = WeightStore(join(root, "lean"), dtype="bfloat16", tied_once=True)
    lean.publish(1, tied)
    got = lean.load(1)
    assert set(got) == {"model.embed_tokens.weight", "steps"}, "the tied head is left for the engine to tie"
    assert got["model.embed_tokens.weight"].dtype == torch.bfloat16 and got["steps"].dtype == torch.int64
    torch.testing.assert_close(got["model.embed_tokens.weight"].float(), embed, rtol=2**-8, atol=0)
    untied = {"a": torch.ones(3), "b": torch.ones(3)}  # equal values, separate tensors: both stay
    lean.publish(2, untied)
    assert set(lean.load(2)) == {"a", "b"}


def test_retention_keeps_the_newest_the_checkpoints_and_the_pinned_versions(root):
    from miles_core.session.checkpoints import checkpoint_versions
    from miles_core.storage.layout import CHECKPOINT_STATE, checkpoint_dir

    layout = RunLayout(root, "toy", "run1")
    store = WeightStore(layout.weights)
    for v in range(1, 11):
        store.publish(v, state_dict(float(v)))
    layout.write_json(f"{checkpoint_dir(4)}/{CHECKPOINT_STATE}", {"step": 4, "version": 4, "data_source": None})
    layout.write_json(f"{checkpoint_dir(8)}/trainer.pt", {})  # a checkpoint whose save did not finish: no state
    store.pin(2, "eval-step-2")
    assert checkpoint_versions(layout) == {4}
    assert store.retain(3, pinned=checkpoint_versions(layout)) == [1, 3, 5, 6, 7]
    assert store.versions() == [2, 4, 8, 9, 10]
    store.unpin(2, "eval-step-2")
    assert store.retain(3, pinned=checkpoint_versions(layout)) == [2]


def test_an_async_runs_retention_keeps_the_versions_its_resume_loads(root):
    """Resumed after step 6, an async run redoes rollout 6 with the version pushed after step 5
    (update_weights_interval 1), or after step 4 (interval 2): the versions just before a checkpoint's
    stay, as the metrics record them (two optimizer steps a rollout: versions 2, 4, ...)."""
    from miles_core.session.checkpoints import checkpoint_versions
    from miles_core.storage.layout import CHECKPOINT_STATE, checkpoint_dir

    layout = RunLayout(root, "toy", "run1")
    layout.write_jsonl("metrics.jsonl", [{"step": k, "version": 2 * k} for k in range(1, 11)])
    layout.write_json(f"{checkpoint_dir(6)}/{CHECKPOINT_STATE}", {"step": 6, "version": 12, "data_source": None})
    assert checkpoint_versions(layout) == {12}
    assert checkpoint_versions(layout, lookback=1) == {10, 12}
    assert checkpoint_versions(layout, lookback=2) == {8, 12}  # pushed after steps 4 and 6 (step 5 pushed nothing)
    assert checkpoint_versions(layout, lookback=3) == {6, 12}  # pushed after step 3; 6 is the checkpoint's own


def test_snapshot_files_are_what_safetensors_reads_for_every_dtype_and_shape(root):
    """The store writes safetensors itself, tensor by tensor: safetensors reads every dtype, a 0-d
    and an empty tensor, a non-contiguous one, and the metadata back exactly."""
    import torch

    state = {"f32": torch.randn(3, 5), "bf16": torch.randn(4).bfloat16(), "i64": torch.arange(7),
             "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
             "transposed": torch.randn(4, 6).t(), "u8": torch.arange(5, dtype=torch.uint8)}
    store = WeightStore(join(root, "w"))
    store.publish(1, state, metadata={"note": "hi"})
    assert store.metadata(1) == {"format": "pt", "note": "hi", "miles.version": "1"}
    loaded = store.load(1)  # safetensors.torch.load of the file's bytes
    assert set(loaded) == set(state)
    for name, t in state.items():
        got = loaded[name]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name


def test_a_snapshot_file_is_read_tensor_by_tensor_into_given_memory(tmp_path):
    """``SafetensorsFile`` reads what safetensors writes, straight into a caller's tensor (a model's
    parameter), and refuses a file cut short, naming it."""
    import torch
    from safetensors.torch import save_file

    from miles_core.storage.weights import SafetensorsFile

    state = {"w": torch.randn(4, 3), "b": torch.randn(5).bfloat16(), "n": torch.arange(3), "e": torch.zeros(0)}
    path = tmp_path / "m.safetensors"
    save_file(state, str(path))
    f = SafetensorsFile(str(path))
    assert f.shape("w") == (4, 3) and f.dtype("b") == torch.bfloat16
    param = torch.empty(4, 3)
    assert f.read_into("w", param) is param and torch.equal(param, state["w"])
    for name, t in state.items():
        assert torch.equal(f.tensor(name), t), name
    with pytest.raises(ValueError, match="cannot be read into a torch.float32 tensor of shape"):
        f.read_into("b", torch.empty(5))  # another dtype: the caller reads a tensor and casts
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match=f"{path}: cut short"):
        SafetensorsFile(str(path))


def test_a_snapshot_whose_write_fails_leaves_no_file_behind(root):
    """A publish that fails half way (here: a dtype snapshots do not store, found before any byte;
    and a tensor that fails while its bytes are written) leaves the version unpublished and no file."""
    import torch

    store = WeightStore(join(root, "w"))
    with pytest.raises(TypeError, match="snapshots do not store"):
        store.publish(1, {"c": torch.zeros(2, dtype=torch.complex64)})

    class Exploding(torch.Tensor):
        pass

    bad = torch.zeros(3).as_subclass(Exploding)
    original = torch.Tensor.to

    def failing_to(self, *a, **k):
        if isinstance(self, Exploding):
            raise RuntimeError("device lost")
        return original(self, *a, **k)

    torch.Tensor.to = failing_to
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            store.publish(1, {"a": torch.ones(4), "b": bad})
    finally:
        torch.Tensor.to = original
    assert store.versions() == [] and not store.fs.exists(join(store.path, "v000001", "model.safetensors"))


def test_a_damaged_segment_is_found_moved_aside_and_its_offset_never_reused(root):
    from miles_core.storage.fs import open_fs
    from miles_core.storage.stream import set_aside_damaged

    run = f"{root.rstrip('/')}/run"
    stream = SampleStream(run)
    for g in range(3):
        stream.append(make_samples(2, g))
    fs, path = open_fs(stream.segment_uri(2))
    data = bytearray(fs.cat_file(path))
    data[40:80] = b"\xff" * 40  # garbage in the middle: the end-of-stream marker is still there
    fs.pipe_file(path, bytes(data))
    assert [o for o, _ in stream.damaged()] == [2]

    (line,) = set_aside_damaged(run)
    assert line.startswith(f"{stream.uri}/damaged/000000000002.arrow: cannot decode sample segment ")
    again = SampleStream(run)
    assert again.offsets() == [0, 1] and again.set_aside() == [2] and not again.damaged()
    assert [s.samples()[0].group_index for s in again.read()] == [0, 1]
    assert again.append(make_samples(2, 3)) == 3, "the damaged segment's offset is not written again"
    assert set_aside_damaged(run) == []


def test_refused_access_and_a_missing_bucket_name_the_object_the_endpoint_and_what_to_check():
    import s3fs

    from miles_core.storage.fs import BucketMissingError

    fs = s3fs.S3FileSystem(key="k", secret="s", client_kwargs={"endpoint_url": "http://store:9000"})

    def refused():
        raise PermissionError("Access Denied")

    with pytest.raises(PermissionError, match=r"s3://b/run/x: storage endpoint http://store:9000 refused access "
                                              r"\(Access Denied\); check the credentials"):
        RetryingFS(fs).call(refused, "b/run/x")

    def gone():
        raise FileNotFoundError("The specified bucket does not exist")

    with pytest.raises(BucketMissingError, match=r"s3://b/run/x: bucket 'b' does not exist on storage endpoint "
                                                 r"http://store:9000 .*restarted without its data"):
        RetryingFS(fs).call(gone, "b/run/x")
