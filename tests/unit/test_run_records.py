"""The run records are written and read back by one module: every record gets its envelope, a kind's required fields
are checked as it is written, and a reader takes complete lines only (a line cut by a kill never becomes a record)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from lightning_fthsdp.protocol.records import RecordKind, RecordReader, RecordWriter, read_records, select


def test_a_record_is_one_line_with_its_envelope_after_its_fields(tmp_path: Path) -> None:
    path = tmp_path / "a.0.jsonl"
    written = RecordWriter(path, "a").write(RecordKind.END, step=3, params_sha256="0" * 64)
    line = path.read_text()
    assert line.endswith("\n") and line.count("\n") == 1
    assert list(json.loads(line)) == ["event", "step", "params_sha256", "t", "replica_id", "pid"]
    assert json.loads(line) == written and written["pid"] == os.getpid() and written["event"] == "end"


def test_a_ranks_records_carry_its_rank(tmp_path: Path) -> None:
    path = tmp_path / "b.jsonl"
    RecordWriter(path, "b", rank=1).write(RecordKind.READY, imports_done=1.5)
    assert read_records(path)[0]["rank"] == 1


def test_without_a_path_nothing_is_written_and_the_record_is_returned(tmp_path: Path) -> None:
    record = RecordWriter(None, "a").write(RecordKind.START, step=0)
    assert record["event"] == "start" and record["replica_id"] == "a"
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_kind_or_a_missing_field_is_refused(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path / "a.jsonl", "a")
    with pytest.raises(ValueError, match=r"no record kind 'comit'"):
        writer.write("comit", step=1)
    with pytest.raises(ValueError, match=r"'val' record needs val_loss too, got step"):
        writer.write(RecordKind.VAL, step=1)
    assert not (tmp_path / "a.jsonl").exists()


def test_records_from_several_threads_land_whole(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    writer = RecordWriter(path, "a")
    threads = [threading.Thread(target=lambda k=k: [writer.write(RecordKind.FOLLOW, step=k * 100 + i, pad="x" * 9000)
                                                    for i in range(20)]) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(r["step"] for r in read_records(path)) == sorted(k * 100 + i for k in range(4) for i in range(20))


def test_a_reader_returns_what_was_completed_since_its_last_read(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    reader = RecordReader(path)
    assert reader.read() == []  # no file yet
    writer = RecordWriter(path, "a")
    writer.write(RecordKind.START, step=0)
    with path.open("a") as sink:
        sink.write('{"event": "commit", "st')  # being written, or cut short by a kill
    assert [r["event"] for r in reader.read()] == ["start"]
    with path.open("a") as sink:
        sink.write('ep": 1}\n')
    assert reader.read() == [{"event": "commit", "step": 1}]
    assert reader.read() == []


def test_a_cut_line_ended_by_the_next_writer_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    writer = RecordWriter(path, "a")
    writer.write(RecordKind.COMMIT, step=1)
    with path.open("a") as sink:
        sink.write('{"event": "commit", "step": 2, "lo\n')  # killed mid-line, then ended (the soak's seal)
    writer.write(RecordKind.COMMIT, step=2)
    assert [r["step"] for r in read_records(path)] == [1, 2]


def test_select_picks_a_kind_and_a_rank() -> None:
    rows = [{"event": "commit", "rank": 0, "step": 1}, {"event": "commit", "rank": 1, "step": 1},
            {"event": "discard", "rank": 0, "step": 2}, {"event": "commit", "rank": 0, "step": 2}]
    assert [r["step"] for r in select(rows)] == [1, 2]
    assert select(rows, RecordKind.DISCARD) == [rows[2]]
    assert select(rows, None, None) == rows
