"""Storage over memory://, file:// and plain paths: the shared contract plus local-only tests.
The same contract runs against s3:// (moto) in tests/integration/test_storage_s3.py."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import pytest

from contract.storage_contract import StorageContract, make_samples
from miles_core.storage import RunLayout, SampleStream, new_run_id
from miles_core.storage.fs import RetryPolicy, StorageUnavailableError, is_transient, with_retries


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
    assert with_retries(flaky, "obj", fs, policy) == "ok" and len(calls) == 3
    def down():
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(StorageUnavailableError, match="obj: storage endpoint .* after 4 attempt"):
        with_retries(down, "obj", fs, RetryPolicy(attempts=4, initial_delay=0.001))
    for permanent in (FileExistsError("x"), FileNotFoundError("x"), ValueError("corrupt")):
        assert not is_transient(permanent)
        with pytest.raises(type(permanent)):
            with_retries(lambda: (_ for _ in ()).throw(permanent), "obj", fs, policy)


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



def test_storage_imports_without_torch_or_pyarrow():
    code = "import sys, miles_core.storage; print(sorted({'torch', 'pyarrow'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
