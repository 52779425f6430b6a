"""A Megatron-LM checkpoint folder someone else made (``convert_checkpoint.py from-megatron``, ``checkpoint_info.py``)
is read in bounded memory, and every crafted input is one line, exit status 2, nothing written (issue 51):

- the sizes in its ``args`` are bounded (``megatron/config/bounds.py``) before anything proportional to them is
  built: ``num_experts`` of 2 x 10^9 in an expert-parallel legacy folder was a MemoryError traceback
  (``merge_ep``'s per-expert set), now one line under a 3 GiB address-space limit;
- its iteration (the tracker, the saved ``iteration``, the args') is a whole number from 0 to 2^40 (before: written
  as ``step_-5``);
- two expert-parallel rank files that are one file (a link) or a copy (the same experts and RNG state) are refused
  (before: silent copies of experts);
- every file it names or holds (``.metadata``, ``common.pt``, ``metadata.json``, rank files and their folders, the
  tracker and the iteration folder it names) is read only inside the folder;
- a crafted torch_dist index or data (a size whose element count overflows int64, a set as a path, chunks that do
  not tile their tensor, data that is not the chunk the index says, stacked layers that are not the args'), legacy
  rank slices that are not cuts of one tensor, and a NaN or negative scheduler position are one line;
- ``checkpoint_info.py`` says "converts" only for what ``from-megatron`` converts: it calls the converter's own
  checks, and refuses in the converter's words.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from megatron import parallel_state
from megatron.checkpoint.megatron_lm.legacy import FILE, TRACKER, safe_load
from tests.functional.launch import program_module
from tests.functional.processes import run_tools_in_bounded_memory
from tests.unit.test_foreign_checkpoints import refused
from tests.unit.test_megatron_checkpoints import SHAPES, convert, our_checkpoint

info = program_module("tools/checkpoint_info.py")
ITER = "iter_0000012"
OUTSIDE = "outside the checkpoint's folder; a checkpoint reads only its own files"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """``to-megatron`` exports (iteration 12) of small GPTs, copied by each test that changes one: torch_dist
    (``dist``), legacy (``legacy``), legacy tp 2 x pp 2 (``tp2pp2``), a Llama-shaped MoE at expert parallelism 2
    (``ep2``: ``mp_rank_00_000``, ``mp_rank_00_001``)."""
    folder = tmp_path_factory.mktemp("hostile")
    parallel_state.initialize()
    try:
        our_checkpoint(folder / "gpt2", SHAPES["gpt2"])
        our_checkpoint(folder / "moe", SHAPES["llama_moe"])
        for name, run, flags in (("dist", "gpt2", ["--format", "torch_dist"]), ("legacy", "gpt2", []),
                                 ("tp2pp2", "gpt2", ["--tp", "2", "--pp", "2"]),
                                 ("ep2", "moe", ["--expert-model-parallel-size", "2"])):
            assert convert.main(["to-megatron", str(folder / run), str(folder / name), *flags]) == 0
    finally:
        parallel_state.destroy()
    return folder


@pytest.fixture
def meg(exports, tmp_path):
    """``meg(kind)``: a fresh copy of that export."""
    def copy(kind: str):
        shutil.copytree(exports / kind, tmp_path / kind)
        return tmp_path / kind
    return copy


def edit(file, change) -> None:
    """``change(the saved dict)`` of a rank file or ``common.pt``, saved back (as a crafter would)."""
    saved = safe_load(str(file))
    change(saved)
    torch.save(saved, file)


def set_args(folder, **values) -> None:
    """``values`` in the args of every rank file / ``common.pt`` of ``folder``'s iteration."""
    for file in [*folder.glob(f"{ITER}/mp_rank_*/{FILE}"), *folder.glob(f"{ITER}/common.pt")]:
        edit(file, lambda saved: vars(saved["args"]).update(values))


def edit_index(folder, change) -> None:
    """``change(the Metadata)`` of a torch_dist ``.metadata`` (our own file: a plain pickle round trip)."""
    index = folder / ITER / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    change(metadata)
    index.write_bytes(pickle.dumps(metadata))


def converter_refuses(folder, tmp_path, capsys) -> str:
    """from-megatron's one line (exit 2, nothing written), without its ``convert_checkpoint.py: error:`` prefix."""
    return refused(folder, tmp_path / "ours", capsys).split(": error: ", 1)[1]


def info_refuses(folder, capsys, verify: bool = False) -> str:
    """What checkpoint_info.py says against the folder: its one-line error (exit 2), or the reason on its last line
    ``converts: no, from-megatron refuses it: ...`` (exit 0)."""
    code = info.main([str(folder), *(["--verify"] if verify else [])])
    out, err = capsys.readouterr()
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("checkpoint_info.py: error: "), err
        return err.strip().split(": error: ", 1)[1]
    assert code == 0 and out.splitlines()[-1].startswith("converts: no, from-megatron refuses it: "), out
    return out.splitlines()[-1].split("refuses it: ", 1)[1]


@pytest.mark.slow
def test_the_sizes_in_the_args_are_bounded_before_anything_is_built(meg, tmp_path):
    """In a process limited to 3 GiB of address space: one line, exit 2, from every reader (before: MemoryError).
    Each reader meets the same check (``megatron_args.check_saved``); the in-process tests below cover the rest."""
    cases = (("ep2", "mp_rank_00_000", {"num_experts": 2 * 10**9}, "num_experts is 2,000,000,000, above the largest",
              ["from-megatron"]),
             ("dist", "", {"num_layers": 10**9}, "num_layers is 1,000,000,000, above the largest",
              ["from-megatron", "info --verify"]))
    calls, wanted = [], []
    for kind, rank, values, message, readers in cases:
        folder = meg(kind)
        set_args(folder, **values)
        where = folder / ITER / (f"{rank}/{FILE}" if rank else "common.pt")
        for reader in readers:
            calls.append(["tools/convert_checkpoint.py", "from-megatron", folder, tmp_path / "ours"]
                         if reader == "from-megatron" else ["tools/checkpoint_info.py", folder, "--verify"])
            wanted.append(f"{where}: its args: {message}")
    for done, line in zip(run_tools_in_bounded_memory(calls, cwd=tmp_path), wanted, strict=True):
        assert done.returncode == 2, (done.args, done.stderr[-2000:])
        assert done.stderr.count("\n") == 1 and line in done.stderr, done.stderr
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("kind, values, message", [
    ("legacy", {"hidden_size": "64"}, "hidden_size is '64', not a whole number"),
    ("legacy", {"tensor_model_parallel_size": 0}, "tensor_model_parallel_size is 0, below 1"),
    ("dist", {"num_attention_heads": 2.5}, "num_attention_heads is 2.5, not a whole number"),
    ("legacy", {"num_layers": 4.0}, "the checkpoint's args: Model.num_layers must be an integer, got '4.0'"),
])
def test_a_size_that_is_not_a_whole_number_in_range_is_one_line(meg, tmp_path, capsys, one_process, kind, values,
                                                                 message):
    folder = meg(kind)
    set_args(folder, **values)
    err = converter_refuses(folder, tmp_path, capsys)
    assert message in err, err
    assert info_refuses(folder, capsys) == err


@pytest.mark.parametrize("kind, where, value", [
    ("legacy", "saved", -5), ("legacy", "saved", 10**30), ("dist", "saved", 1e30), ("dist", "saved", math.nan),
    ("legacy", "args", -5), ("legacy", "tracker", 10**30),
])
def test_an_iteration_outside_0_to_2_to_the_40_is_one_line(meg, tmp_path, capsys, one_process, kind, where, value):
    """Before: written as step_-5 / step_1000...0, which no loader accepts (NaN: a ValueError traceback)."""
    folder = meg(kind)
    if where == "tracker":
        (folder / ITER).rename(folder / f"iter_{value:07d}")
        (folder / TRACKER).write_text(str(value))
    else:
        file = folder / ITER / ("common.pt" if kind == "dist" else f"mp_rank_00/{FILE}")
        edit(file, (lambda s: s.update(iteration=value)) if where == "saved" else
             (lambda s: (s.pop("iteration"), setattr(s["args"], "iteration", value))))
    err = converter_refuses(folder, tmp_path, capsys)
    assert "a whole number from 0 to 2^40" in err and ("iteration is" in err or where == "tracker"), err
    assert info_refuses(folder, capsys) == err


@pytest.mark.parametrize("how", ["copy", "folder link", "file link", "hard link"])
def test_a_duplicated_expert_parallel_rank_file_is_one_line(meg, tmp_path, capsys, one_process, how):
    """mp_rank_00_000 again as expert-parallel rank 1: before, its experts were converted as experts 2 and 3."""
    folder = meg("ep2") / ITER
    first, second = folder / "mp_rank_00_000", folder / "mp_rank_00_001"
    if how in ("copy", "folder link"):
        shutil.rmtree(second)
        shutil.copytree(first, second) if how == "copy" else os.symlink(first, second)
    else:
        (second / FILE).unlink()
        (os.symlink if how == "file link" else os.link)(first / FILE, second / FILE)
    err = converter_refuses(folder.parent, tmp_path, capsys)
    if how == "copy":
        assert f"{second / FILE} holds the same experts (and RNG state) as {first / FILE}" in err, err
    else:
        assert "mp_rank_00_001/model_optim_rng.pt and mp_rank_00_000/model_optim_rng.pt are one file" in err, err
    assert info_refuses(folder.parent, capsys, verify=True) == err


@pytest.mark.parametrize("kind, name", [
    ("dist", ".metadata"), ("dist", "common.pt"), ("dist", "metadata.json"), ("legacy", f"mp_rank_00/{FILE}"),
    ("legacy", "mp_rank_00"), ("tp2pp2", f"mp_rank_01_001/{FILE}"), ("legacy", TRACKER), ("legacy", ITER),
])
def test_every_file_a_megatron_folder_names_or_holds_is_read_only_inside_it(meg, tmp_path, capsys, one_process, kind,
                                                                             name):
    """Each a link to a real copy outside, so a reader that followed it would convert with exit 0."""
    folder = meg(kind)
    inside = folder / name if name in (TRACKER, ITER) else folder / ITER / name
    outside = tmp_path / "elsewhere" / inside.name
    outside.parent.mkdir()
    shutil.move(inside, outside)
    os.symlink(outside, inside)
    err = converter_refuses(folder, tmp_path, capsys)
    assert f"a link to {outside}" in err and OUTSIDE in err, err
    assert info_refuses(folder, capsys) == err


def _metadata_size(key, size):
    def change(metadata):
        meta = metadata.state_dict_metadata[key]
        meta.size = meta.chunks[0].sizes = torch.Size(size)
    return change


def _chunks(key, chunks, size=None):
    def change(metadata):
        meta = metadata.state_dict_metadata[key]
        meta.chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
        meta.size = torch.Size(size or meta.size)
    return change


def _all_storage(**values):
    def change(metadata):
        for info_ in metadata.storage_data.values():
            vars(info_).update(values)
    return change


def _dtype(key, dtype):
    def change(metadata):
        metadata.state_dict_metadata[key].properties.dtype = dtype
    return change


def _key(key):
    def change(metadata):
        metadata.state_dict_metadata[frozenset([key])] = metadata.state_dict_metadata.pop(key)
    return change


EMBEDDING, NORM = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"


@pytest.mark.parametrize("change, message", [
    (_metadata_size(EMBEDDING, [2**62, 2**62, 16]), "more than its data files hold"),  # numel() wraps to 0
    (_all_storage(relative_path={"__0_0.distcp"}), "names a data file by {'__0_0.distcp'}, not a file name"),
    (_chunks(EMBEDDING, [([0, 0], [128, 16])]), "hold 2,048 elements of its 4,096 ([256, 16]): they do not tile it"),
    (_chunks(EMBEDDING, [([0, 0], [256, 16]), ([0, 0], [256, 16])], [512, 16]), "[512, 16]), overlapping"),
    (_metadata_size(NORM, [8]), "holds [16] of torch.float32 for the chunk of 'decoder.final_layernorm.weight' at "
                                "offsets [0], which .metadata says is [8] of torch.float32"),
    (_dtype(EMBEDDING, torch.bfloat16), "which .metadata says is [256, 16] of torch.bfloat16"),
    (_all_storage(transform_descriptors=["zstd"]), "transformed (['zstd']), which this tool does not read"),
    (_key(EMBEDDING), "names a tensor by frozenset({'embedding.word_embeddings.weight'}), not a name"),
    ("num_layers 3", "the shape [2, 16], but the args say num_layers 3"),
], ids=["numel overflow", "set as path", "gap", "overlap", "index and data sizes", "index and data dtypes",
        "transformed", "key not a name", "layers not the args'"])
def test_a_crafted_torch_dist_index_or_data_is_one_line(meg, tmp_path, capsys, one_process, change, message):
    """Before: tracebacks (overflow, set, key), or a silent conversion (a gap left rows of torch.empty, a dtype cast,
    a larger data narrowed to the index's size)."""
    folder = meg("dist")
    if change == "num_layers 3":
        set_args(folder, num_layers=3)
    else:
        edit_index(folder, change)
    err = converter_refuses(folder, tmp_path, capsys)
    assert message in err, err
    assert info_refuses(folder, capsys, verify=True) == err


@pytest.mark.parametrize("content", [None, "{", "[]", '{"sharded_backend": "zarr"}'],
                         ids=["missing", "not JSON", "a list", "another backend"])
def test_a_torch_dist_folder_whose_metadata_json_is_damaged_says_so(meg, tmp_path, capsys, one_process, content):
    """Before: the line spoke of legacy rank files (``has no mp_rank_00/model_optim_rng.pt, ...``)."""
    folder = meg("dist")
    path = folder / ITER / "metadata.json"
    path.unlink()
    if content is not None:
        path.write_text(content)
    err = converter_refuses(folder, tmp_path, capsys)
    assert "holds a torch_dist index (.metadata), but its metadata.json is missing, damaged or not Megatron's" in err
    assert info_refuses(folder, capsys) == err


@pytest.mark.parametrize("rank, change, message", [
    ("mp_rank_01_000", lambda s: s["model"].update({"decoder.layers.0.self_attention.linear_proj.weight":
                                                    torch.zeros(8, 8)}),
     "decoder.layers.0.self_attention.linear_proj.weight has tensor-parallel slices of shapes [16, 8], [8, 8], which "
     "are not cuts of one tensor along dim 1"),
    ("mp_rank_01_001", lambda s: s.update(model=[1, 2]), "holds no 'model' state dict (a list)"),
    ("mp_rank_00_001", lambda s: s["model"].update({"decoder.final_layernorm.weight": "x"}),
     "holds 'decoder.final_layernorm.weight' as a str, not a tensor"),
])
def test_a_legacy_rank_that_is_not_one_of_the_checkpoints_is_one_line(meg, tmp_path, capsys, one_process, rank,
                                                                       change, message):
    """Before: torch.cat's RuntimeError, or AttributeErrors, as tracebacks."""
    folder = meg("tp2pp2")
    edit(folder / ITER / rank / FILE, change)
    err = converter_refuses(folder, tmp_path, capsys)
    assert message in err, err
    assert info_refuses(folder, capsys, verify=True) == err


SCHEDULER = {"max_lr": 1e-3, "min_lr": 0.0, "lr_warmup_steps": 0, "lr_decay_steps": 1000, "lr_decay_style": "cosine",
             "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 1000, "num_steps": 96}


@pytest.mark.parametrize("scheduler, args, message", [
    ({"num_steps": math.nan}, {}, "opt_param_scheduler: num_steps is nan, not a number of samples from 0"),
    ({"num_steps": -96}, {}, "opt_param_scheduler: num_steps is -96, not a number of samples from 0"),
    ({"max_lr": math.inf}, {}, "opt_param_scheduler: max_lr is inf, not a finite number"),
    ({"lr_decay_steps": 0}, {}, "opt_param_scheduler: lr_decay_steps is 0, not a number of samples above 0"),
    ({}, {"consumed_train_samples": math.nan}, "args: consumed_train_samples is nan, not a whole number from 0"),
    ({}, {"global_batch_size": "8"}, "args: global_batch_size is '8', not a whole number from 0"),
])
def test_a_crafted_schedule_or_progress_is_one_line(meg, tmp_path, capsys, one_process, scheduler, args, message):
    """Before: ``int(nan)``'s ValueError traceback, or a run resuming at -96 samples."""
    folder = meg("dist")
    edit(folder / ITER / "common.pt", lambda s: s.update(opt_param_scheduler={**SCHEDULER, **scheduler}))
    set_args(folder, **args)
    err = converter_refuses(folder, tmp_path, capsys)
    assert f"the checkpoint's {message}; the checkpoint is damaged" in err, err
    assert info_refuses(folder, capsys) == err


def test_an_unknown_weight_decay_style_is_said_as_an_unknown_decay_style_is(meg, tmp_path, capsys, one_process):
    """Both tools: a note, the schedule left to the resuming run's flags (before: checkpoint_info.py's ValueError)."""
    folder = meg("dist")
    edit(folder / ITER / "common.pt", lambda s: s.update(opt_param_scheduler={**SCHEDULER, "wd_incr_style": "x"}))
    note = "Megatron's weight-decay increment style 'x' is not one of ('constant', 'linear', 'cosine')"
    assert info.main([str(folder)]) == 0
    assert f"scheduler: {note}" in capsys.readouterr().out
    assert convert.main(["from-megatron", str(folder), str(tmp_path / "ours")]) == 0
    assert note in capsys.readouterr().out


def _missing_rank(folder):
    set_args(folder, tensor_model_parallel_size=2)


def _expert_tensor_parallel(folder):
    set_args(folder, expert_tensor_parallel_size=2)


def _virtual_pipeline(folder):
    edit(folder / ITER / "mp_rank_00" / FILE, lambda s: s.update(model0=s.pop("model")))


def _heads(folder):
    set_args(folder, num_attention_heads=3)


def _ffn(folder):
    set_args(folder, ffn_hidden_size=7)


@pytest.mark.parametrize("kind, damage, message, by_args", [
    ("legacy", _missing_rank, "mp_rank_01/model_optim_rng.pt is missing", True),
    ("ep2", _expert_tensor_parallel, "was saved with expert tensor parallelism 2 under tensor parallelism 1", True),
    ("legacy", _virtual_pipeline, "virtual pipeline chunks are not converted", True),
    ("legacy", _heads, "Model.num_attention_heads (3) must divide Model.hidden_size (16)", True),
    ("legacy", _ffn, "has shape [24, 16], but the configured model's is [7, 16]", False),
], ids=["missing rank file", "expert tensor parallelism", "virtual pipeline", "heads", "ffn"])
def test_checkpoint_info_says_converts_only_for_what_from_megatron_converts(meg, tmp_path, capsys, one_process, kind,
                                                                             damage, message, by_args):
    """In from-megatron's words, by its own checks; the checks that need the tensors with --verify (before: "converts:
    the model" for all of these, and "converts: yes" with --verify for the last two)."""
    folder = meg(kind)
    damage(folder)
    err = converter_refuses(folder, tmp_path, capsys)
    assert message in err, err
    assert info_refuses(folder, capsys, verify=True) == err
    if by_args:
        assert info_refuses(folder, capsys) == err
    else:
        assert info.main([str(folder)]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith("converts: the model, by its args and rank files")


@pytest.mark.parametrize("kind", ["dist", "legacy", "tp2pp2", "ep2"])
def test_an_untouched_export_still_converts_and_says_so(meg, tmp_path, capsys, one_process, kind):
    folder = meg(kind)
    assert info.main([str(folder), "--verify"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("converts: yes (from-megatron): ")
    assert convert.main(["from-megatron", str(folder), str(tmp_path / "ours")]) == 0
