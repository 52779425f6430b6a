"""A checkpoint is data, never code. Every loader (``pretrain_gpt.py --load``, ``tools/generate.py``,
``tools/evaluate.py``, ``tools/serve.py``, ``convert_checkpoint.py to-hf`` / ``reshard`` / ``to-megatron``,
``checkpoint_info.py --verify``) refuses a checkpoint whose pickles name anything but plain data, in
one line, without running it; the checkpoints written before format 4 (pickled ``common.pt`` and
``rank{r}.rng.pt``) still load, to the same state as their JSON form; a crafted JSON file is a
one-line refusal too."""

from __future__ import annotations

import json
import random
import shutil
import zlib

import numpy as np
import pytest
import torch

from megatron.checkpoint import CheckpointError
from megatron.checkpoint.resume import NOT_INHERITED, check_resume_settings, resumed_config
from megatron.config import ConfigError, parse_config
from megatron.tensor_parallel import get_rng_tracker
from tests.functional.launch import run_here, run_tool_here
from tests.unit.legacy_checkpoints import as_legacy_format, plant_payload
from tests.unit.test_checkpoint_safety import load
from tests.unit.test_checkpoint_tools import TINY, make_config, trained_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run folder saved by training's save_checkpoint (format 4), copied by each test that changes it."""
    return trained_checkpoint(tmp_path_factory.mktemp("trust") / "run", make_config(), steps=2)


@pytest.fixture
def legacy(saved, tmp_path):
    """A copy of ``saved`` in format 3 (pickled common.pt and rank0.rng.pt, as before format 4)."""
    run = tmp_path / "legacy"
    shutil.copytree(saved, run)
    as_legacy_format(run / "step_2", version=3)
    return run


def _loaders(tmp_path, ckpt):
    text = tmp_path / "text.txt"
    text.write_text("11 12 13 14 15\n")  # NullTokenizer: token ids
    infer = ["--load", str(ckpt), "--tokenizer-type", "NullTokenizer"]
    return {
        "pretrain_gpt --load": lambda: run_here("--mock-data", "--device", "cpu", *TINY, "--global-batch-size", "4",
                                                "--micro-batch-size", "4", "--max-steps", "3", "--num-workers", "0",
                                                "--load", str(ckpt), "--save", str(tmp_path / "resumed")),
        "generate": lambda: run_tool_here("tools/generate.py", *infer, "--prompt", "1 2 3", "--max-new-tokens", "2"),
        "evaluate": lambda: run_tool_here("tools/evaluate.py", "--task", "perplexity", "--input", str(text),
                                          "--load", str(ckpt), "--tokenizer-type", "NullTokenizer"),
        # an address no machine has: a loader that went past the checkpoint fails to bind (it never serves)
        "serve": lambda: run_tool_here("tools/serve.py", *infer, "--host", "256.0.0.1", "--port", "0"),
        "convert to-hf": lambda: run_tool_here("tools/convert_checkpoint.py", "to-hf", str(ckpt), str(tmp_path / "hf"),
                                               "--no-tokenizer"),
        "convert reshard": lambda: run_tool_here("tools/convert_checkpoint.py", "reshard", str(ckpt),
                                                 str(tmp_path / "tp2"), "--tp", "2"),
        "convert to-megatron": lambda: run_tool_here("tools/convert_checkpoint.py", "to-megatron", str(ckpt),
                                                     str(tmp_path / "megatron")),
        "checkpoint_info --verify": lambda: run_tool_here("tools/checkpoint_info.py", str(ckpt), "--verify"),
    }


LOADERS = ("pretrain_gpt --load", "generate", "evaluate", "serve", "convert to-hf", "convert reshard",
           "convert to-megatron", "checkpoint_info --verify")


# common.pt is read by every loader; a rank's RNG file by a resume under the same layout, and by --verify
PLANTED = [*(("common.pt", name) for name in LOADERS),
           *(("rank0.rng.pt", name) for name in ("pretrain_gpt --load", "checkpoint_info --verify"))]


@pytest.mark.parametrize(("planted", "name"), PLANTED, ids=[f"{p}-{n.split()[0]}-{n.split()[-1]}" for p, n in PLANTED])
def test_a_crafted_pickle_is_refused_by_every_loader_and_never_runs(legacy, tmp_path, planted, name):
    """The payload (``os.system('touch MARKER')``) sits inside otherwise valid content and its checksum is
    recorded, as whoever crafted the file would do: the checksums are no defence, the reader is."""
    if name == "serve":  # the server's packages are the serve (and reference) extra's
        pytest.importorskip("fastapi")
        pytest.importorskip("uvicorn")
    marker = tmp_path / "payload-ran"
    plant_payload(legacy / "step_2", planted, f"touch {marker}")
    loaders = _loaders(tmp_path, legacy)
    result = loaders[name]()
    text = (result.stderr + result.stdout).strip()
    assert not marker.exists(), f"{name} ran the payload"
    assert result.returncode != 0, f"{name} accepted the checkpoint: {text[-300:]}"
    lines = [line for line in text.splitlines() if "refusing" in line]
    assert lines, f"{name}: {text[-500:]}"
    assert f"refusing {legacy / 'step_2' / planted}: its pickle names posix.system, which a checkpoint never " \
           f"holds" in lines[0], f"{name}: {lines[0]}"


def test_checkpoint_info_verify_refuses_a_crafted_rng_file_it_would_otherwise_only_checksum(legacy, tmp_path):
    marker = tmp_path / "payload-ran"
    plant_payload(legacy / "step_2", "rank0.rng.pt", f"touch {marker}")
    result = run_tool_here("tools/checkpoint_info.py", str(legacy), "--verify")
    assert result.returncode == 2 and not marker.exists()
    assert "refusing" in result.stderr and result.stderr.count("\n") == 1


def _state_after_load(run):
    loaded = load(run)
    return loaded, (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state(),
                    get_rng_tracker().get_states())


@pytest.mark.parametrize("version", [2, 3])
def test_a_checkpoint_of_an_earlier_format_loads_to_the_same_state(saved, tmp_path, version):
    """Formats 2 and 3 (pickled small files) load through the restricted unpickler to exactly the state the
    JSON files of format 4 give: the train state, the loss scaler and every RNG stream."""
    current, current_rng = _state_after_load(saved)
    old = tmp_path / "old"
    shutil.copytree(saved, old)
    as_legacy_format(old / "step_2", version=version)
    assert (old / "step_2" / "common.pt").exists() and not (old / "step_2" / "common.json").exists()
    loaded, rng = _state_after_load(old)
    assert {k: loaded[k] for k in ("step", "consumed_samples", "skipped_steps")} == \
        {k: current[k] for k in ("step", "consumed_samples", "skipped_steps")}
    assert rng[0] == current_rng[0] and np.array_equal(rng[1], current_rng[1])
    assert torch.equal(rng[2], current_rng[2])
    assert rng[3].keys() == current_rng[3].keys() and all(torch.equal(rng[3][k], current_rng[3][k]) for k in rng[3])


def _rewrite_json(step_dir, name, change):
    path = step_dir / name
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))
    _record_checksum(step_dir, name)


def _record_checksum(step_dir, name):
    """A crafted file comes with its checksum: whoever wrote it wrote metadata.json too."""
    metadata = json.loads((step_dir / "metadata.json").read_text())
    metadata["files"][name] = zlib.crc32((step_dir / name).read_bytes())
    (step_dir / "metadata.json").write_text(json.dumps(metadata))


@pytest.mark.parametrize("name, change, message", [
    ("common.json", lambda v: v.update(step="2; rm -rf /"), "step is '2; rm -rf /', not an integer >= 0"),
    ("common.json", lambda v: v.update(step=-1), "step is -1, not an integer >= 0"),
    ("common.json", lambda v: v["train_state"].update(consumed_samples=10**30),
     "train_state.consumed_samples is 1000000000000000000000000000000, not an integer from 0 to 9007199254740992"),
    ("common.json", lambda v: v.update(grad_scaler={"scale": "1e30"}), "grad_scaler.scale is '1e30', not a finite"),
    ("common.json", lambda v: v["train_state"].update(consumed_samples=[1] * 1000), "train_state.consumed_samples"),
    ("common.json", lambda v: v.pop("config"), "it lacks 'config'"),
    ("rank0.rng.json", lambda v: v.update(torch="not base64!"), "torch is not base64"),
    ("rank0.rng.json", lambda v: v.update(torch="AAAA"), "torch is not a generator state of"),
    ("rank0.rng.json", lambda v: v["tracker"].update({k: "AAAA" for k in v["tracker"]}),
     "tracker.model-parallel is not a generator state of 5056 or 16 bytes"),
    ("rank0.rng.json", lambda v: v["python"]["state"].pop(), "its Python RNG state is not 624 32-bit words"),
    ("rank0.rng.json", lambda v: v["numpy"].update(keys=[-1] * 624), "its NumPy RNG state is not an MT19937"),
], ids=["step-text", "step-negative", "samples-huge", "scale-text", "samples-list", "no-config", "rng-text",
        "rng-size", "tracker-size",
        "python-rng", "numpy-rng"])
def test_a_crafted_json_file_is_one_line(saved, tmp_path, name, change, message):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    _rewrite_json(run / "step_2", name, change)
    with pytest.raises(CheckpointError) as raised:
        load(run)
    text = str(raised.value)
    assert f"refusing {run / 'step_2' / name}: {message}" in text and "\n" not in text


def test_a_non_finite_number_is_not_json(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    path = run / "step_2" / "common.json"
    path.write_text(path.read_text().replace('"adam_step": 2.0', '"adam_step": NaN'))
    _record_checksum(run / "step_2", "common.json")
    with pytest.raises(CheckpointError, match="it is not valid JSON .*NaN is not a number a checkpoint holds"):
        load(run)


# ---------------------------------------------------------------- what a resume may not change


def _resume(ckpt, *flags):
    return resumed_config(["--load", str(ckpt), "--mock-data", "--device", "cpu", *flags])


@pytest.mark.parametrize("flags, message", [
    (("--num-attention-heads", "8"), "with num_attention_heads 8, but the saved run has 4: a setting of the model "
                                     "(its shape or what it computes) must stay as saved; drop it, pass "
                                     "--override-model-settings to change it from here on, or start a new run from "
                                     "these weights with --finetune."),
    (("--layernorm-epsilon", "1e-06"), "with layernorm_epsilon 1e-06, but the saved run has 1e-05"),
    (("--kv-channels", "8"), "with kv_channels 8, but the saved run has 16"),  # the derived value, not None
    (("--seed", "7"), "with seed 7, but the saved run has 1024: the data would be read in another order from step 2 "
                      "on; drop it, pass --override-data-order to change the data from here on, or use --finetune."),
    (("--max-seq-len", "16"), "with max_seq_len 16, but the saved run has 32"),
    (("--split", "90,10,0"), "with split '90,10,0', but the saved run has '949,50,1'"),
], ids=["heads", "epsilon", "kv-channels", "seed", "seq-len", "split"])
def test_a_resume_that_changes_the_model_or_the_data_order_is_one_line(saved, flags, message):
    """Heads over the same hidden size or another epsilon load without a shape error, and would be read as
    another model; another seed, sequence length or split would read the data in another order."""
    with pytest.raises(ConfigError) as raised:
        _resume(saved, *flags)
    assert f"resuming {saved} {message}" in str(raised.value)


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
    """A top-2 softmax-routed mixture of experts at step 2 (random weights: only its configuration is read)."""
    from megatron.checkpoint.convert import tensor_layout, write_params

    config = make_config("--num-experts", "4", "--moe-router-topk", "2")
    params = {name: torch.zeros(shape) for name, (shape, _) in tensor_layout(config).items()}
    run = tmp_path_factory.mktemp("trust-moe") / "run"
    write_params(str(run), config, params, step=2, train_state={"consumed_samples": 8, "skipped_steps": 0})
    return run


@pytest.mark.parametrize("flags, message", [
    (("--moe-router-topk", "1"), "with moe_router_topk 1, but the saved run has 2"),
    (("--moe-router-score-function", "sigmoid"), "with moe_router_score_function 'sigmoid', but the saved run has "
                                                 "'softmax'"),
    (("--moe-router-pre-softmax",), "with moe_router_pre_softmax True, but the saved run has False"),
    (("--moe-expert-capacity-factor", "1.0"), "with moe_expert_capacity_factor 1.0, but the saved run has None"),
], ids=["topk", "sigmoid", "pre-softmax", "capacity"])
def test_a_resume_that_changes_the_router_is_one_line(saved_moe, flags, message):
    """The same tensors, another router: the saved experts would see other tokens."""
    with pytest.raises(ConfigError) as raised:
        _resume(saved_moe, *flags)
    assert f"resuming {saved_moe} {message}: a setting of the model" in str(raised.value)
    assert "--override-model-settings" in str(raised.value)


def test_every_model_setting_is_held_on_resume_unless_listed_as_free():
    """A new model setting is held by default: only the objective's, precision's and speed's settings are free."""
    from megatron.checkpoint.resume import MODEL_MAY_CHANGE, MODEL_NOT_CHANGED

    assert {"moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax", "moe_expert_capacity_factor",
            "rotary_base", "normalization", "swiglu", "layernorm_epsilon"} <= set(MODEL_NOT_CHANGED)
    assert not set(MODEL_MAY_CHANGE) & set(MODEL_NOT_CHANGED)


def test_what_a_resume_may_change(saved, saved_moe):
    assert _resume(saved_moe, "--moe-router-topk", "1", "--override-model-settings").model.moe_router_topk == 1
    assert _resume(saved_moe, "--moe-aux-loss-coeff", "0.01").model.moe_aux_loss_coeff == 0.01  # the objective
    assert _resume(saved, "--moe-router-topk", "1").model.moe_router_topk == 1  # no experts: no router to change
    assert _resume(saved, "--num-attention-heads", "8", "--override-model-settings").model.num_attention_heads == 8
    assert "override_model_settings" in NOT_INHERITED
    assert _resume(saved, "--seed", "7", "--override-data-order").seed == 7  # said on purpose
    assert _resume(saved, "--seed", "7", "--finetune").seed == 7  # a new run from the weights
    assert _resume(saved, "--seed", "1024", "--lr", "1e-4").optimizer.lr.max_lr == 1e-4  # the same value; the lr
    assert _resume(saved, "--hidden-dropout", "0.2").model.hidden_dropout_prob == 0.2  # dropout shapes neither
    assert _resume(saved, "--kv-channels", "16").model.kv_channels == 16  # the derived value, given explicitly
    assert _resume(saved, "--override-data-order").save_load.override_data_order  # not inherited by the next resume
    assert "override_data_order" in NOT_INHERITED


def test_a_moved_data_folder_is_the_same_data():
    base = parse_config(["--input-dir", "0.3 /data/a/web_text_document 0.7 /data/b/code_text_document"])
    moved = parse_config(["--input-dir", "0.3 /local/ssd/web_text_document 0.7 /local/ssd/code_text_document"])
    check_resume_settings(base, moved, "run", 10)
    reweighted = parse_config(["--input-dir", "0.5 /data/a/web_text_document 0.5 /data/b/code_text_document"])
    with pytest.raises(ConfigError, match="with input_dir '0.5 /data/a/web_text_document 0.5 /data/b/code_text_docu"):
        check_resume_settings(base, reweighted, "run", 10)
    check_resume_settings(base, reweighted, "run", 0)  # nothing consumed yet (an import): no order to keep


def test_a_checkpoint_of_another_shape_is_one_line_naming_the_tensor(saved):
    """What the configuration check cannot see (a --finetune, a checkpoint without its config): the shapes."""
    from megatron import parallel_state
    from megatron.checkpoint import load_checkpoint
    from tests.unit.test_checkpoint_tools import build_buffer_and_optimizer, our_model

    config = make_config("--hidden-size", "128")
    model = our_model(config)
    _, optimizer = build_buffer_and_optimizer(model, config)
    with pytest.raises(CheckpointError, match=r"has shape \[256, 64\] in the checkpoint but \[256, 128\] in the model"):
        load_checkpoint(str(saved), model, optimizer, parallel_state.get(), config, load_optim=False)


@pytest.mark.parametrize("run, change, message", [
    ("saved", ("--num-attention-heads", "8"), "with num_attention_heads 8, but the saved run has 4"),
    ("saved_moe", ("--moe-router-topk", "1"), "with moe_router_topk 1, but the saved run has 2"),
])
def test_pretrain_refuses_the_changed_resume_in_one_line_before_training(request, tmp_path, run, change, message):
    ckpt = request.getfixturevalue(run)
    result = run_here("--mock-data", "--device", "cpu", *TINY, "--global-batch-size", "4", "--micro-batch-size", "4",
                      "--max-steps", "3", "--num-workers", "0", "--load", str(ckpt), "--save", str(tmp_path / "out"),
                      *change)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out" / "latest").exists()


@pytest.mark.parametrize("field, value", [("rank", "/../../../etc/passwd"), ("offset", -4), ("lo", "0"),
                                          ("global_shape", [64, "x"]), ("kind", "os.system"), ("tp_rank", 3)])
def test_a_crafted_metadata_field_is_one_line_and_reads_nothing_outside(saved, tmp_path, field, value):
    """metadata.json steers every read (which rank file, where in it): a field of another type or range than the
    format writes (a path in place of a rank, a negative offset) is refused before any read."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    path = run / "step_2" / "metadata.json"
    metadata = json.loads(path.read_text())
    metadata["pieces"][3][field] = value
    path.write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError) as raised:
        load(run)
    assert f"metadata.json is damaged (a piece's '{field}' is" in str(raised.value)
    assert "\n" not in str(raised.value)


# ---------------------------------------------------------------- crafted to exhaust, or to reach outside


def _crafted(saved, tmp_path, harm):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    harm(run / "step_2")
    return run


def _files(step, name, crc=0):
    metadata = json.loads((step / "metadata.json").read_text())
    metadata["files"][name] = crc
    (step / "metadata.json").write_text(json.dumps(metadata))


def _duplicate_piece(step):
    metadata = json.loads((step / "metadata.json").read_text())
    metadata["pieces"].append(dict(metadata["pieces"][3]))
    (step / "metadata.json").write_text(json.dumps(metadata))


def _huge_common(step):
    with open(step / "common.json", "r+b") as f:
        f.truncate(65 << 20)  # sparse: 65 MiB that read as zeros


def _rng_position(step):
    value = json.loads((step / "rank0.rng.json").read_text())
    value["numpy"]["pos"] = 10**6  # NumPy would read past its 624 words (a segfault)
    (step / "rank0.rng.json").write_text(json.dumps(value))
    _record_checksum(step, "rank0.rng.json")


@pytest.mark.parametrize("harm, message", [
    (lambda s: _files(s, "../../../../etc/hostname"), "'files' names a file the format does not write"),
    (lambda s: _files(s, "/dev/zero"), "'files' names a file the format does not write"),
    (_duplicate_piece, "two pieces of "),
    (_huge_common, "common.json: it is 68,157,440 bytes, more than any checkpoint's small file"),
    (_rng_position, "the NumPy RNG position is 1000000, not an integer from 0 to 624"),
], ids=["files-outside", "files-device", "duplicate-piece", "huge-small-file", "rng-position"])
def test_a_checkpoint_crafted_to_reach_outside_or_exhaust_is_one_line(saved, tmp_path, harm, message):
    run = _crafted(saved, tmp_path, harm)
    with pytest.raises(CheckpointError) as raised:
        load(run)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    result = run_tool_here("tools/checkpoint_info.py", str(run), "--verify")
    assert result.returncode == 2 and message in result.stderr, result.stderr[-500:]


def test_a_latest_linked_to_an_endless_file_is_read_no_further_than_a_name(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    (run / "latest").unlink()
    (run / "latest").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="not a step folder name"):
        load(run)


def test_legacy_pickles_that_would_exhaust_memory_or_time_are_refused(legacy, tmp_path):
    """Only allowed names, but a shared list nested deep (exponential to walk), a NumPy state of 2e8 words, and a
    deflated tensor far larger than its file: each refused before the cost."""
    step = legacy / "step_2"
    common = torch.load(step / "common.pt", weights_only=False)
    shared = [1]
    for _ in range(7):
        shared = [shared] * 200
    torch.save({**common, "train_state": {**common["train_state"], "x": shared}}, step / "common.pt")
    _record_checksum(step, "common.pt")
    with pytest.raises(CheckpointError, match="train_state holds 'x'"):
        load(legacy)
    rng = torch.load(step / "rank0.rng.pt", weights_only=False)
    name, keys, *rest = rng["numpy"]
    torch.save({**rng, "numpy": (name, np.zeros(10**6, dtype=np.uint32), *rest)}, step / "rank0.rng.pt")
    _record_checksum(step, "rank0.rng.pt")
    torch.save(common, step / "common.pt")
    _record_checksum(step, "common.pt")
    with pytest.raises(CheckpointError, match="its NumPy RNG state is not"):
        load(legacy)


def test_a_resume_of_a_copied_folder_never_writes_into_the_original(saved, tmp_path):
    """The saved config names the folder it was written to (and a downloaded one could name any): where this
    launch writes is this launch's (its --save, else the default), never inherited."""
    import yaml

    from megatron.config import Config

    own = tmp_path / "own"
    shutil.copytree(saved, own)
    step = own / "step_2"
    saved_config = yaml.safe_load((step / "config.yaml").read_text())
    saved_config["save_load"].update(output_dir=str(own), tensorboard_dir=str(tmp_path / "tb"))
    (step / "config.yaml").write_text(yaml.safe_dump(saved_config))
    _record_checksum(step, "config.yaml")
    inherited = _resume(own).save_load  # the run's own folder: its settings, where it writes included
    assert (inherited.output_dir, inherited.tensorboard_dir) == (str(own), str(tmp_path / "tb"))
    copy = tmp_path / "copy"
    shutil.copytree(own, copy)
    config = _resume(copy)  # a copy names the original: nothing of where to write is taken
    assert config.save_load.output_dir == Config().save_load.output_dir
    assert config.save_load.tensorboard_dir is None


def test_a_yaml_alias_bomb_for_a_number_is_one_line(tmp_path):
    levels = ["&a [x, x, x, x, x, x, x, x, x, x]"] + [f"&{c} [{', '.join(['*' + p] * 10)}]"
                                                       for p, c in zip("abcdefg", "bcdefgh")]
    bomb = f"max_steps: [{', '.join(levels)}]\n"  # 10^8 leaves if expanded (a saved config.yaml could hold it)
    (tmp_path / "bomb.yaml").write_text(bomb)
    with pytest.raises(ConfigError, match="max_steps must be a single int, got a list"):
        parse_config(["-c", str(tmp_path / "bomb.yaml")])
