"""Weights & Biases logging (--wandb-project, --wandb-exp-name, --wandb-save-dir, as Megatron-LM): its
configuration checks, the start-up error when wandb is missing, and offline runs whose recorded history
is read back and compared with metrics.jsonl, value for value.

wandb is optional: the tests that run it skip when it is not installed."""

from __future__ import annotations

import json
import logging
import re
import struct
import sys
from pathlib import Path

import pytest

import pretrain_gpt
from megatron.config import ConfigError, parse_config, validate
from megatron.metrics import WANDB_RUN_ID_FILE, MetricsWriter, get_logger, scalars
from tests.functional.launch import TINY, run
from tests.functional.processes import error_lines


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb, offline and quiet, with its settings and caches in ``tmp_path`` (not the user's home)."""
    wandb = pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                        "WANDB_CONFIG_DIR": tmp_path / "wandb_config", "WANDB_CACHE_DIR": tmp_path / "wandb_cache",
                        "WANDB_DATA_DIR": tmp_path / "wandb_data"}.items():
        monkeypatch.setenv(name, str(value))
    yield wandb
    wandb.teardown()  # the in-process service; a no-op when only child processes used wandb


def read_records(path: Path) -> list:
    """The protobuf records of an offline run's ``run-<id>.wandb`` file. Its framing is LevelDB's log
    format, as wandb writes it: a 7-byte file header (``:W&B``, magic, version), then 32 KiB blocks of
    chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); a block's
    tail shorter than a chunk header is padding. wandb ships no reader of its own any more."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(records: list) -> dict[int, dict[str, float]]:
    """step -> the values logged at that step (wandb's own ``_step``, ``_runtime``... left out)."""
    rows: dict[int, dict[str, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = rows.setdefault(record.history.step.num, {})
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    row[key] = json.loads(item.value_json)
    return rows


def run_record(records: list):
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def expected_history(out: Path) -> dict[int, dict[str, float]]:
    """What metrics.jsonl says W&B should hold: each record's finite numbers under ``split/key``, by step (a
    resume's record marks the file only)."""
    rows: dict[int, dict[str, float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] != "resume":
            rows.setdefault(record["step"], {}).update(scalars(record))
    return rows


# ---------------------------------------------------------------- configuration and start-up errors


@pytest.mark.parametrize("flag", ["--wandb-exp-name", "--wandb-save-dir"])
def test_wandb_settings_without_a_project_are_a_config_error(flag):
    config = parse_config(["--mock-data", "--device", "cpu", flag, "x"])
    with pytest.raises(ConfigError, match=rf"^wandb_\w+ is set but wandb_project is not: give --wandb-project .*"
                                          rf"or drop {flag}\.$"):
        validate(config)


def test_missing_wandb_stops_the_run_before_training_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError, as when not installed
    out = tmp_path / "out"
    assert pretrain_gpt.main([*TINY, "--save", str(out), "--wandb-project", "p"]) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1
    assert errors[0].startswith("pretrain_gpt.py: error: --wandb-project is set but wandb cannot be imported (")
    assert errors[0].endswith("); pip install wandb, or drop --wandb-project.")
    assert not (out / "metrics.jsonl").exists() and not (out / "latest").exists()  # nothing trained, nothing written


# ---------------------------------------------------------------- offline runs, read back


def test_a_resume_continues_the_w_and_b_run_and_a_fresh_start_does_not(tmp_path, offline_wandb):
    """In process, through MetricsWriter: the id kept in output_dir, its reuse on resume only, the warning
    when W&B already holds steps the resumed run logs again, and only the enabled rank starting W&B."""
    out, save_dir = tmp_path / "out", tmp_path / "wb"
    config = parse_config(["--mock-data", "--save", str(out), "--wandb-project", "p", "--wandb-save-dir",
                           str(save_dir)])
    MetricsWriter(str(out), None, enabled=False, config=config).close()
    assert not save_dir.exists()  # not the logging rank: no W&B run
    first = MetricsWriter(str(out), None, config=config)
    for step in (1, 2, 3):
        first.write({"split": "train", "step": step, "loss": 1.0 / step})
    first.close()
    run_id = (out / WANDB_RUN_ID_FILE).read_text().strip()

    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    get_logger().addHandler(handler)
    try:
        MetricsWriter(str(out), None, resume_step=1, config=config).close()  # a resume from step 1
    finally:
        get_logger().removeHandler(handler)
    assert (out / WANDB_RUN_ID_FILE).read_text().strip() == run_id
    assert messages == [f"W&B run {run_id} already holds the earlier run's steps past 1: W&B ignores steps logged "
                        f"again, so there they keep the earlier run's values (metrics.jsonl has this run's)"]

    MetricsWriter(str(out), None, config=config).close()  # no --load: a new W&B run
    assert (out / WANDB_RUN_ID_FILE).read_text().strip() != run_id
    runs = sorted(p.name for p in (save_dir / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>, with "-1" added when two of the same id start within the same second
    assert len(runs) == 3 and sum(bool(re.search(rf"-{run_id}(-\d+)?$", name)) for name in runs) == 2


@pytest.mark.slow
def test_an_offline_training_run_logs_what_metrics_jsonl_holds_and_its_resume_continues_it(tmp_path, offline_wandb):
    out, save_dir = tmp_path / "out", tmp_path / "wb"
    wandb_flags = ("--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", str(save_dir))
    first = run(out, *TINY, "--max-steps", "5", "--lr-decay-iters", "10", "--save-steps", "5", *wandb_flags)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(out, *TINY, "--load", str(out))  # inherits the W&B settings from the saved config
    assert second.returncode == 0, second.stderr[-3000:]

    run_id = (out / WANDB_RUN_ID_FILE).read_text().strip()
    folders = sorted((save_dir / "wandb").glob("offline-run-*"))  # named by start time: the first run first
    assert [f.name.endswith(f"-{run_id}") for f in folders] == [True, True]
    logs = [read_records(folder / f"run-{run_id}.wandb") for folder in folders]
    assert [run_record(records).display_name for records in logs] == ["e", "e"]
    assert [run_record(records).project for records in logs] == ["p", "p"]
    config = {item.key: json.loads(item.value_json) for item in run_record(logs[0]).config.update}
    assert config["Model"]["hidden_size"] == 64 and config["save_load"]["wandb_project"] == "p"

    first_history, second_history = history(logs[0]), history(logs[1])
    assert sorted(first_history) == [1, 2, 3, 4, 5] and sorted(second_history) == [6, 7, 8, 9, 10]
    expected = expected_history(out)
    assert {**first_history, **second_history} == expected  # every step, key and value (exact floats)
    assert {"train/loss", "train/learning_rate", "valid/loss", "test/perplexity"} <= set(expected[5])
