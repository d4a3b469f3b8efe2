"""compact_run: a sample stream archived as Parquet, over memory:// and file://."""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from miles_core.storage import SampleStream, open_fs
from miles_core.storage.archive import DICTIONARY_COLUMNS, MANIFEST, OFFSET_COLUMN, archive_dataset, compact_run
from miles_core.types import Sample, SampleStatus, table_to_samples


@pytest.fixture(params=["memory", "file"])
def run_dir(request, tmp_path) -> str:
    if request.param == "memory":
        return f"memory://test-archive-{uuid.uuid4().hex}/run"
    return f"file://{tmp_path}/run"


def make_segment(seg: int, n: int = 4) -> list[Sample]:
    """n samples of group ``seg``; rewards and logprobs are exact in float32."""
    statuses = [SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.COMPLETED, SampleStatus.FAILED]
    return [
        Sample(
            prompt=f"q{seg}",
            prompt_ids=[1, 2, 100 + seg],
            response_ids=list(range(seg * 10, seg * 10 + i + 1)),
            response="r" * (i + 1),
            label=None if i == 3 else str(seg),
            reward=None if i == 3 else [1.0, 0.5, 0.0][i],
            loss_mask=[1] * (i + 1),
            rollout_logprobs=[-0.5] * (i + 1),
            span_starts=[0],
            span_versions=[seg],
            status=statuses[i % 4],
            group_index=seg,
            sample_index=i,
            prompt_index=seg,
            adapter="lora-a" if seg % 2 else None,
            error="reward timeout" if statuses[i % 4] is SampleStatus.FAILED else None,
            metadata={"seg": seg, "i": i},
        )
        for i in range(n)
    ]


def fill(run_dir: str, segments: int = 3) -> list[list[Sample]]:
    stream = SampleStream(run_dir)
    appended = [make_segment(s) for s in range(segments)]
    for samples in appended:
        stream.append(samples)
    stream.close()
    return appended


def read_part(url: str) -> pa.Table:
    fs, path = open_fs(url)
    with fs.open(path, "rb") as f:
        return pq.read_table(pa.BufferReader(f.read()))


def test_round_trip_equals_appended_samples(run_dir):
    appended = fill(run_dir)
    report = compact_run(run_dir)
    assert (report.segments, report.rows, report.first_offset, report.last_offset) == (3, 12, 0, 2)
    assert report.closed and len(report.files) == 1 and report.files[0].endswith("archive/rollout/part-00000.parquet")
    assert report.bytes_in > 0 and report.bytes_out > 0
    table = read_part(report.files[0])
    # every column, every value: Sample equality covers all fields of arrow_schema()
    assert table_to_samples(table.drop_columns([OFFSET_COLUMN])) == [s for seg in appended for s in seg]
    assert table.column(OFFSET_COLUMN).to_pylist() == [0] * 4 + [1] * 4 + [2] * 4


def test_dictionary_only_on_low_cardinality_columns(run_dir):
    fill(run_dir)
    meta = pq.ParquetFile(pa.BufferReader(_bytes(compact_run(run_dir).files[0]))).metadata
    encodings = {
        meta.row_group(0).column(i).path_in_schema.split(".")[0]: set(meta.row_group(0).column(i).encodings)
        for i in range(meta.num_columns)
    }
    for name in ("status", "adapter", "label", "prompt"):
        assert {"RLE_DICTIONARY", "PLAIN_DICTIONARY"} & encodings[name], (name, encodings[name])
    for name in ("prompt_ids", "response_ids", "rollout_logprobs", "response", OFFSET_COLUMN):
        assert not {"RLE_DICTIONARY", "PLAIN_DICTIONARY"} & encodings[name], (name, encodings[name])
    assert meta.row_group(0).column(0).compression == "ZSTD"
    assert set(DICTIONARY_COLUMNS) >= {"status", "adapter", "label"}


def test_dataset_query_mean_reward_by_status(run_dir):
    fill(run_dir)
    report = compact_run(run_dir)
    table = archive_dataset(report.out_url).to_table(columns=["status", "reward"])
    got = {r["status"]: r["reward_mean"] for r in table.group_by("status").aggregate([("reward", "mean")]).to_pylist()}
    # per segment: completed rewards 1.0 and 0.0, truncated 0.5, failed None (ignored by mean).
    # completed over 3 segments: (1 + 0) * 3 / 6 = 0.5; truncated: 0.5; failed: no values -> None
    assert got == {"completed": 0.5, "truncated": 0.5, "failed": None}
    # the manifest is not data, and a filter on the offset column reaches one segment
    n = archive_dataset(report.out_url).count_rows(filter=pc.field(OFFSET_COLUMN) == 1)
    assert n == 4


def test_manifest_written_and_parts_split(run_dir):
    fill(run_dir, segments=5)
    report = compact_run(run_dir, rows_per_file=8, row_group_size=4)
    # whole segments per file: 4 + 4 rows, then a new part once 8 are in it
    assert [u.rsplit("/", 1)[1] for u in report.files] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert pq.ParquetFile(pa.BufferReader(_bytes(report.files[0]))).metadata.num_row_groups == 2
    fs, path = open_fs(report.out_url)
    manifest = json.loads(fs.cat_file(f"{path}/{MANIFEST}"))
    assert manifest["rows"] == 20 and manifest["files"] == report.files
    # a smaller re-run removes the parts it no longer writes
    again = compact_run(run_dir)
    assert len(again.files) == 1
    assert archive_dataset(again.out_url).count_rows() == 20


def test_out_url_and_open_stream(run_dir, tmp_path):
    stream = SampleStream(run_dir, producer="eval")
    stream.append(make_segment(7))
    out = f"file://{tmp_path}/elsewhere"
    report = compact_run(run_dir, producer="eval", out_url=out)
    assert not report.closed and report.rows == 4
    assert report.files == [f"{tmp_path}/elsewhere/part-00000.parquet"]


def test_empty_stream_is_a_clear_error(run_dir):
    with pytest.raises(ValueError, match=r"nothing to archive.*no segments.*'rollout'"):
        compact_run(run_dir)


def test_unknown_dictionary_column_is_an_error(run_dir):
    fill(run_dir, segments=1)
    with pytest.raises(ValueError, match="statuz"):
        compact_run(run_dir, dictionary_columns=("statuz",))


def _bytes(url: str) -> bytes:
    fs, path = open_fs(url)
    return fs.cat_file(path)
