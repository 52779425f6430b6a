"""A Megatron-LM torch_dist checkpoint (PyTorch's distributed checkpoint: ``.metadata`` + ``*.distcp``) that someone
else wrote is data, read only inside its folder (``megatron/checkpoint/megatron_lm/dcp_reader.py``): a ``.metadata``
whose pickle reaches code through a dotted name after an allowed module, an index naming a data file outside the folder
(``..``, an absolute path, a symlink out), or a truncated, empty or garbage data file is one line and exit status 2
from ``convert_checkpoint.py from-megatron``; the payload never runs and nothing is written. A Hugging Face
folder's ``model.safetensors.index.json`` likewise names only the folder's own shards."""

from __future__ import annotations

import os
import pickle
import shutil
import struct

import pytest

from megatron import parallel_state
from megatron.checkpoint.megatron_lm.dcp_reader import ALLOWED
from tests.unit.test_megatron_checkpoints import SHAPES, convert, our_checkpoint


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A torch_dist export of a small GPT (iteration 12), copied by each test that changes it."""
    folder = tmp_path_factory.mktemp("foreign")
    parallel_state.initialize()
    try:
        our_checkpoint(folder / "run", SHAPES["gpt2"])
        assert convert.main(["to-megatron", str(folder / "run"), str(folder / "meg"), "--format", "torch_dist"]) == 0
    finally:
        parallel_state.destroy()
    return folder / "meg"


@pytest.fixture
def meg(exported, tmp_path):
    shutil.copytree(exported, tmp_path / "meg")
    return tmp_path / "meg"


def _short(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def stack_global_call(module: str, name: str, argument: str) -> bytes:
    """Protocol 4's ``STACK_GLOBAL module name`` called with one string: what a crafted ``.metadata`` holds."""
    return (b"\x80\x04" + _short(module) + _short(name) + b"\x93" + _short(argument) + b"\x85" + b"R" + b".")


def refused(meg, out, capsys) -> str:
    assert convert.main(["from-megatron", str(meg), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not out.exists()
    return err


@pytest.mark.parametrize("module, name", [
    ("torch.distributed.checkpoint.filesystem", "os.system"),
    ("torch.distributed.checkpoint.metadata", "os.system"),
    ("torch.distributed.checkpoint.planner", "torch.os.system"),
    ("torch", "os.system"),
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"),
])
def test_a_dotted_name_after_an_allowed_module_never_runs(meg, tmp_path, capsys, module, name):
    marker = tmp_path / "payload-ran"
    (meg / "iter_0000012" / ".metadata").write_bytes(stack_global_call(module, name, f"touch {marker}"))
    err = refused(meg, tmp_path / "ours", capsys)
    assert not marker.exists()
    assert f".metadata holds {module}.{name}, which this tool does not unpickle" in err, err


def test_the_allow_list_holds_plain_names_only():
    assert all("." not in name for _, name in ALLOWED)


def _rewrite_paths(meg, path_of) -> None:
    """Rewrite the index's data-file paths (our own file: a plain pickle round trip), as a crafter would."""
    index = meg / "iter_0000012" / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = path_of(info.relative_path)
    index.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_a_data_file_outside_the_folder_is_never_read(meg, tmp_path, capsys, where):
    """Each points at a real copy of the data, so a reader that followed it would convert with exit 0."""
    data = meg / "iter_0000012" / "__0_0.distcp"
    outside = tmp_path / "outside.distcp"
    shutil.copy(data, outside)
    if where == "symlink":
        data.unlink()
        os.symlink(outside, data)
    else:
        target = "../../outside.distcp" if where == "dotdot" else str(outside)
        _rewrite_paths(meg, lambda _: target)
    before = os.stat(outside).st_atime_ns
    err = refused(meg, tmp_path / "ours", capsys)
    assert "outside the checkpoint's folder; a checkpoint reads only its own files" in err, err
    assert os.stat(outside).st_atime_ns == before or where == "symlink"  # realpath only stats the link target


@pytest.mark.parametrize("damage, message", [
    ("truncate", "the data file is truncated or the index damaged"),
    ("empty", "the data file is truncated or the index damaged"),
    ("garbage", "a data file is damaged or truncated (UnpicklingError"),
    ("missing", "which is missing from"),
])
def test_a_damaged_data_file_is_one_line(meg, tmp_path, capsys, damage, message):
    data = meg / "iter_0000012" / "__0_0.distcp"
    size = data.stat().st_size
    if damage == "truncate":
        os.truncate(data, size // 2)
    elif damage == "empty":
        data.write_bytes(b"")
    elif damage == "garbage":
        data.write_bytes(struct.pack("<I", 0xDEADBEEF) * (size // 4))
    else:
        data.unlink()
    err = refused(meg, tmp_path / "ours", capsys)
    assert message in err, err
    assert "weights_only` set to `False" not in err  # torch.load's advice is not for someone else's file


def test_an_index_declaring_more_tensor_bytes_than_its_files_hold_is_refused_before_allocating(meg, tmp_path,
                                                                                                 capsys):
    import torch

    index = meg / "iter_0000012" / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    key = next(k for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size"))
    metadata.state_dict_metadata[key].size = torch.Size([1 << 40, 1 << 10])  # 4 PiB of fp32
    index.write_bytes(pickle.dumps(metadata))
    err = refused(meg, tmp_path / "ours", capsys)
    assert "more than its data files hold" in err, err


@pytest.mark.parametrize("where", ["inside", "dotdot", "absolute", "symlink"])
def test_a_hugging_face_index_reads_only_the_folders_own_shards(tmp_path, where):
    """``model.safetensors.index.json`` names the shard files: one outside the folder is refused, never read."""
    import json

    import torch
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    outside = tmp_path / "outside.safetensors"
    save_file({"b": torch.ones(2)}, str(outside))
    save_file({"a": torch.zeros(2)}, str(hf / "model-00001-of-00002.safetensors"))
    second = {"inside": "model-00002-of-00002.safetensors", "dotdot": "../outside.safetensors",
              "absolute": str(outside), "symlink": "model-00002-of-00002.safetensors"}[where]
    if where == "inside":
        shutil.copy(outside, hf / second)
    elif where == "symlink":
        os.symlink(outside, hf / second)
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": second}}))
    if where == "inside":
        assert sorted(convert.read_hf_state_dict(str(hf))) == ["a", "b"]
        return
    with pytest.raises(convert.ToolError) as raised:
        convert.read_hf_state_dict(str(hf))
    assert "outside the checkpoint's folder; a checkpoint reads only its own files" in str(raised.value)
