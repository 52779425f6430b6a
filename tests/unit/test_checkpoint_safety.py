"""Checkpoint safety, in one process: checksums (written, checked on every read, partial reads, format 2
read unverified), ``checkpoint_info.py --verify``, what counts as "no checkpoint yet", failed saves
(one line, nothing pruned, ``latest`` untouched), pruning, the output-folder check, metrics.jsonl
after a resume, and what a resumed run's configuration sees of all this (``checkpoint.resume``)."""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

from megatron import parallel_state
from megatron.checkpoint import (
    CheckpointError,
    CheckpointReader,
    check_output_dir,
    claim_output_dir,
    find_checkpoint,
    load_checkpoint,
    ownership,
)
from megatron.checkpoint.format import RankFileWriter, write_text
from megatron.checkpoint.resume import resume_base, resumed_config
from megatron.checkpoint.save_load import prune_checkpoints, save_checkpoint
from megatron.config import parse_config
from megatron.metrics import MetricsWriter, drop_records_after, get_logger
from tests.unit.legacy_checkpoints import as_legacy_format
from tests.unit.test_checkpoint_tools import (
    build_buffer_and_optimizer,
    info,
    make_config,
    our_model,
    trained_checkpoint,
)

CPU = torch.device("cpu")
DENSE = "layers.1.mlp.dense_4h_to_h.weight"


def flip_byte(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def piece_of(step_dir, kind: str, name: str) -> dict:
    metadata = json.loads((step_dir / "metadata.json").read_text())
    return next(p for p in metadata["pieces"] if p["kind"] == kind and p["name"] == name)


@pytest.fixture
def run_dir(tmp_path):
    """A run folder with the saves of steps 1 and 2 (latest: step_2), written by save_checkpoint."""
    config = make_config()
    trained_checkpoint(tmp_path / "run", config, steps=1)
    trained_checkpoint(tmp_path / "run", config, steps=2)
    return tmp_path / "run"


def load(path, **kwargs):
    config = make_config()
    model = our_model(config)
    _, optimizer = build_buffer_and_optimizer(model, config)
    return load_checkpoint(str(path), model, optimizer, parallel_state.get(), config, **kwargs)


# ---------------------------------------------------------------- checksums


def test_every_piece_and_file_carries_a_checksum(run_dir):
    step = run_dir / "step_2"
    metadata = json.loads((step / "metadata.json").read_text())
    assert metadata["format_version"] == 4 and metadata["checksum"] == {"algorithm": "crc32", "chunk_bytes": 4 << 20}
    assert set(metadata["files"]) == {"common.json", "config.yaml", "rank0.rng.json"}
    for name, crc in metadata["files"].items():
        assert zlib.crc32((step / name).read_bytes()) == crc
    data = (step / "rank0.bin").read_bytes()
    for piece in metadata["pieces"]:  # every piece is below 4 MiB here: one CRC each
        assert piece["crc32"] == [zlib.crc32(data[piece["offset"]:piece["offset"] + 4 * (piece["hi"] - piece["lo"])])]
    assert load(run_dir)["step"] == 2


@pytest.mark.parametrize("target, message", [
    ("rank0.bin", "rank0.bin: checksum mismatch in exp_avg 'layers.1.mlp.dense_4h_to_h.weight'"),
    ("common.json", "common.json does not match its checksum in metadata.json: the file is corrupt"),
    ("rank0.rng.json", "rank0.rng.json does not match its checksum in metadata.json: the file is corrupt"),
    ("config.yaml", "config.yaml does not match its checksum in metadata.json: the file is corrupt"),
], ids=["rank-file", "common", "rng", "config"])
def test_a_flipped_byte_stops_the_load_naming_the_file_and_an_earlier_checkpoint(run_dir, target, message):
    step = run_dir / "step_2"
    offset = piece_of(step, "exp_avg", DENSE)["offset"] + 100 if target == "rank0.bin" else 60
    flip_byte(step / target, offset)
    with pytest.raises(CheckpointError) as raised:
        load(run_dir)
    text = str(raised.value)
    assert message in text and "\n" not in text
    assert text.endswith(f"load an earlier checkpoint instead (--load {run_dir / 'step_1'}).")
    assert info.main([str(run_dir / "step_1"), "--verify"]) == 0  # the earlier one is intact


def test_a_partial_read_checks_every_chunk_it_touches_and_only_those(tmp_path):
    """A piece of 4096 floats in 1 KiB chunks (16 CRCs): a read of part of it reads the chunks it
    touches, whole, checks them, and returns exactly the asked values."""
    values = torch.arange(4096, dtype=torch.float32)
    writer = RankFileWriter(str(tmp_path), 0, chunk_bytes=1024)
    piece = {**writer.add(values), "kind": "param", "name": "w", "lo": 0, "hi": 4096, "global_shape": [4096],
             "partition_dim": None, "tp_rank": 0, "tp_size": 1, "local_shape": [4096]}
    writer.close()
    assert len(piece["crc32"]) == 16
    write_text(str(tmp_path / "metadata.json"), json.dumps({
        "format_version": 3, "layout": {}, "checksum": {"algorithm": "crc32", "chunk_bytes": 1024},
        "pieces": [piece]}))
    reader = CheckpointReader(str(tmp_path))
    assert torch.equal(reader.read_piece(piece, 300, 700), values[300:700])  # chunks 1-2 (256 floats each)
    assert reader.bytes_read == 2 * 1024
    flip_byte(tmp_path / "rank0.bin", 10 * 1024 + 5)  # chunk 10
    assert torch.equal(reader.read_piece(piece, 0, 2560), values[:2560])  # chunks 0-9: not the damaged one
    with pytest.raises(CheckpointError, match=r"checksum mismatch in param 'w' \(bytes 10240-11264\)"):
        reader.read_piece(piece, 2600, 2601)  # one value of chunk 10: the whole chunk is checked
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        reader.verify_all()
    reader.close()


def test_format_2_without_checksums_loads_with_a_warning(run_dir, caplog, capsys):
    as_legacy_format(run_dir / "step_2", version=2)
    get_logger().addHandler(caplog.handler)  # the project's logger does not propagate to the root
    try:
        assert load(run_dir)["step"] == 2
    finally:
        get_logger().removeHandler(caplog.handler)
    assert "checkpoint format 2, which has no checksums: its data is loaded unverified" in caplog.text
    assert info.main([str(run_dir), "--verify"]) == 0
    assert "checksums: none (format 2 has none)" in capsys.readouterr().out


def test_checkpoint_info_verify_reports_a_mismatch_in_one_line(run_dir, capsys):
    assert info.main([str(run_dir), "--verify"]) == 0
    assert "checksums: all match (84 pieces, " in capsys.readouterr().out
    flip_byte(run_dir / "step_2" / "rank0.bin", piece_of(run_dir / "step_2", "param", DENSE)["offset"])
    assert info.main([str(run_dir), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"rank0.bin: checksum mismatch in param '{DENSE}'" in err


# ---------------------------------------------------------------- "no checkpoint yet" and damaged ones


def _layout(root, kind: str):
    """Build one situation of a load path under ``root``; returns the path to give --load."""
    run = root / "run"
    if kind in ("never-saved", "empty", "killed-first-save", "dangling", "steps-without-latest", "latest-is-a-dir",
                "bad-latest"):
        run.mkdir()
    if kind == "never-saved":
        (run / "metrics.jsonl").write_text('{"split": "train", "step": 1}\n')
        (run / "config.yaml").write_text("not: [a checkpoint\n")
    if kind == "killed-first-save":
        (run / "step_5.tmp").mkdir()
    if kind == "dangling":
        (run / "latest").write_text("step_9")
    if kind in ("steps-without-latest", "incomplete-step"):
        (run / "step_5").mkdir(parents=True)
    if kind == "latest-is-a-dir":
        (run / "latest").mkdir()
    if kind == "bad-latest":
        (run / "latest").write_text("../../etc")
    if kind == "a-file":
        run.write_text("x")
    return run / "step_5" if kind == "incomplete-step" else run


LOAD_PATHS = {  # situation: None (no checkpoint at all) or the error
    "missing": None, "empty": None, "never-saved": None, "killed-first-save": None,
    "dangling": "latest names", "steps-without-latest": "holds step folders but no 'latest' file",
    "incomplete-step": "holds no metadata.json: its save is incomplete or damaged",
    "latest-is-a-dir": "cannot read", "bad-latest": "not a step folder name", "a-file": "is a file",
}


@pytest.mark.parametrize("kind", list(LOAD_PATHS))
def test_no_checkpoint_yet_starts_fresh_and_a_damaged_one_is_an_error(tmp_path, kind):
    path, error = _layout(tmp_path, kind), LOAD_PATHS[kind]
    argv = ["--mock-data", "--load", str(path), "--save", str(path)]
    if error is None:
        assert find_checkpoint(str(path)) is None
        assert resume_base(parse_config(argv).save_load) is None  # no saved base
        assert resumed_config(argv).model.hidden_size == parse_config([]).model.hidden_size
        assert load(path, fresh_if_empty=True) is None  # the run's own folder: from scratch
        with pytest.raises(CheckpointError, match="no checkpoint at"):  # another folder: an error
            load(path)
        return
    with pytest.raises(CheckpointError, match=error):
        find_checkpoint(str(path))
    with pytest.raises(CheckpointError, match=error):  # the same, one line, before any process group exists
        resumed_config(argv)
    with pytest.raises(CheckpointError, match=error):
        load(path, fresh_if_empty=True)


# ---------------------------------------------------------------- failed saves and pruning


def _save(out, step: int, keep_last: int | None = None) -> str:
    config = make_config()
    model = our_model(config)
    _, optimizer = build_buffer_and_optimizer(model, config)
    return save_checkpoint(str(out), step, model, optimizer, parallel_state.get(), config,
                           {"consumed_samples": 0, "skipped_steps": 0}, keep_last)


def _no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


SAVE_FAILURES = {"tmp-is-a-file": "step_3.tmp is in the way of saves: it is a file",
                 "step-is-a-file": "step_3 is in the way of saves: it is a file, not a checkpoint folder, and a save "
                                   "of that step would move it aside; move it out of the folder",
                 "old-is-a-link": "step_3.old is in the way of saves: it is a link",
                 "latest-is-a-dir": "cannot save", "disk-full": "No space left on device"}


@pytest.mark.parametrize("obstacle", list(SAVE_FAILURES))
def test_a_failed_save_is_one_line_and_prunes_nothing(run_dir, monkeypatch, obstacle):
    message = SAVE_FAILURES[obstacle]
    if obstacle == "tmp-is-a-file":
        (run_dir / "step_3.tmp").write_text("x")
    if obstacle == "step-is-a-file":  # was moved aside to step_3.old without a word
        (run_dir / "step_3").write_text("a user's file")
    if obstacle == "old-is-a-link":
        (run_dir / "step_3.old").symlink_to(run_dir / "step_1")
    if obstacle == "latest-is-a-dir":
        (run_dir / "latest").unlink()
        (run_dir / "latest").mkdir()
    if obstacle == "disk-full":
        monkeypatch.setattr(RankFileWriter, "add", _no_space)
    with pytest.raises(CheckpointError) as raised:
        _save(run_dir, 3, keep_last=1)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert (run_dir / "step_1").is_dir() and (run_dir / "step_2").is_dir()  # nothing pruned
    if obstacle != "latest-is-a-dir":
        assert (run_dir / "latest").read_text() == "step_2" and not (run_dir / "step_3").is_dir()
    if obstacle == "step-is-a-file":
        assert (run_dir / "step_3").read_text() == "a user's file" and not (run_dir / "step_3.old").exists()
    assert not (run_dir / "step_3.tmp").is_dir()
    assert info.main([str(run_dir / "step_2"), "--verify"]) == 0


def test_a_failed_first_save_does_not_speak_of_a_previous_checkpoint(tmp_path, monkeypatch):
    """Before: 'the previous checkpoint and 'latest' are unchanged' where the run had saved none."""
    monkeypatch.setattr(RankFileWriter, "add", _no_space)
    with pytest.raises(CheckpointError) as raised:
        _save(tmp_path / "run", 1)
    message = str(raised.value)
    assert "No space left on device" in message and "previous checkpoint" not in message, message
    assert f"no checkpoint was saved in {tmp_path / 'run'} before this one: fix this and start the run again" in message


def test_pruning_keeps_the_newest_and_what_latest_names(tmp_path):
    out = tmp_path / "run"
    for step in (1, 2, 3):
        _save(out, step, keep_last=2)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step_")) == ["step_2", "step_3"]
    (out / "latest").write_text("step_2")  # as if step_3 were another attempt's
    prune_checkpoints(str(out), 4, 1)
    assert (out / "step_2").is_dir() and not (out / "step_3").exists()  # named by latest: kept


# ---------------------------------------------------------------- the output folder and metrics.jsonl


OUTPUT_DIRS = {"a-file": "is a file; give --save a folder", "latest-is-a-dir": "latest is in the way",
               "tmp-is-a-file": "step_4.tmp is in the way of saves",
               "step-is-a-file": "step_4 is in the way of saves: it is a file, not a checkpoint folder",
               "old-is-a-file": "step_4.old is in the way of saves: it is a file", "leftover-tmp": None}


def test_a_refused_run_leaves_the_other_runs_interrupted_save(run_dir):
    """The step_N.tmp of another run's interrupted save is removed only by a run the folder belongs to."""
    (run_dir / "step_3.tmp").mkdir()
    check_output_dir(str(run_dir), 0, CPU)
    try:
        with pytest.raises(CheckpointError, match="holds another run"):
            claim_output_dir(ownership.Start(str(run_dir), None, None, None, False), 0, CPU, False, None)
    finally:
        ownership.release(str(run_dir))
    assert (run_dir / "step_3.tmp").is_dir()


@pytest.mark.parametrize("obstacle", list(OUTPUT_DIRS))
def test_the_output_folder_check(tmp_path, obstacle):
    out, message = tmp_path / "out", OUTPUT_DIRS[obstacle]
    if obstacle == "a-file":
        out.write_text("x")
    else:
        out.mkdir()
    if obstacle == "latest-is-a-dir":
        (out / "latest").mkdir()
    if obstacle in ("tmp-is-a-file", "step-is-a-file", "old-is-a-file"):
        (out / {"tmp-is-a-file": "step_4.tmp", "step-is-a-file": "step_4", "old-is-a-file": "step_4.old"}[
            obstacle]).write_text("x")
    if obstacle == "leftover-tmp":
        (out / "step_4.tmp").mkdir()
        (out / "step_4.tmp" / "rank0.bin").write_bytes(b"partial")
    if message is None:
        check_output_dir(str(out), 0, CPU)
        assert sorted(os.listdir(out)) == ["run.lock", "step_4.tmp"]  # no probe file left; the leftover waits
        claim_output_dir(ownership.Start(str(out), None, None, None, False), 0, CPU, False, None)
        assert sorted(os.listdir(out)) == ["run.json", "run.lock"]  # the folder is this run's: its leftover goes
        ownership.release(str(out))  # the end of the run: its lock goes
        assert sorted(os.listdir(out)) == ["run.json"]
        return
    before = sorted(os.listdir(out)) if out.is_dir() else None
    with pytest.raises(CheckpointError, match=message):
        check_output_dir(str(out), 0, CPU)
    assert (sorted(os.listdir(out)) if out.is_dir() else None) == before  # nothing moved, nothing left behind


def _record(split: str, step: int) -> str:
    return json.dumps({"split": split, "step": step, "loss": 1.0}) + "\n"


def test_a_resume_drops_the_later_records_of_an_earlier_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [_record("train", s) for s in range(1, 7)] + [_record("valid", 3), _record("valid", 6), _record("test", 6)]
    path.write_text("".join(lines) + '{"split": "train", "st')  # a killed run's partial last line
    assert drop_records_after(str(path), 3) == 6
    assert path.read_text() == "".join(lines[:3] + [lines[6]])
    before = path.stat().st_mtime_ns
    assert drop_records_after(str(path), 3) == 0 and path.stat().st_mtime_ns == before  # untouched
    writer = MetricsWriter(str(tmp_path), str(tmp_path / "tb"), resume_step=2)
    writer.write({"split": "train", "step": 3, "loss": 2.0})
    writer.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("resume", 2), ("train", 3)]
    assert records[2]["dropped"] == 2  # the train and valid records of step 3 that the resume from 2 dropped
