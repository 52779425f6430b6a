"""Step folders as earlier versions wrote them, made from a current one: formats 2 and 3 kept
``common`` and each rank's RNG streams as ``torch.save`` pickles (``common.pt``, ``rank{r}.rng.pt``),
with the same content the JSON files hold now. Also a crafted pickle, as an attacker would plant it."""

from __future__ import annotations

import json
import os
import zlib

import torch

from megatron.checkpoint import small_files


def as_legacy_format(step_dir, version: int = 3) -> None:
    """Rewrite ``step_dir`` (format 4) as format ``version`` (2: no checksums; 3: checksums) wrote it."""
    step_dir = str(step_dir)
    meta_path = os.path.join(step_dir, "metadata.json")
    with open(meta_path) as f:
        metadata = json.load(f)
    files = {}
    common_json = os.path.join(step_dir, small_files.COMMON_FILE)
    with open(common_json) as f:
        common = json.load(f)
    torch.save({**common, "format_version": version}, os.path.join(step_dir, "common.pt"))
    os.remove(common_json)
    files["common.pt"] = None
    for name in sorted(os.listdir(step_dir)):
        if name.endswith(".rng.json"):
            with open(os.path.join(step_dir, name)) as f:
                state = small_files.decode_rng(json.load(f))  # the tuples, arrays and tensors _rng_state gives
            torch.save(state, os.path.join(step_dir, name[:-len(".json")] + ".pt"))
            os.remove(os.path.join(step_dir, name))
            files[name[:-len(".json")] + ".pt"] = None
    files["config.yaml"] = None
    metadata["format_version"] = version
    if version >= 3:
        metadata["files"] = {name: _crc(os.path.join(step_dir, name)) for name in files}
    else:
        for key in ("checksum", "files"):
            metadata.pop(key, None)
        for piece in metadata["pieces"]:
            piece.pop("crc32", None)
    with open(meta_path, "w") as f:
        json.dump(metadata, f)


def _crc(path: str) -> int:
    with open(path, "rb") as f:
        return zlib.crc32(f.read())


class Payload:
    """Unpickling this runs ``os.system(command)``: what a crafted checkpoint file would carry."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def plant_payload(step_dir, name: str, command: str) -> None:
    """Replace the pickle ``name`` of a format-3 ``step_dir`` by one that runs ``command`` when unpickled
    (inside otherwise valid content), and record its checksum, as whoever crafted it would."""
    step_dir = str(step_dir)
    path = os.path.join(step_dir, name)
    value = torch.load(path, weights_only=False)  # our own file, written just before
    value["train_state" if name == "common.pt" else "tracker"]["payload"] = Payload(command)
    torch.save(value, path)
    meta_path = os.path.join(step_dir, "metadata.json")
    with open(meta_path) as f:
        metadata = json.load(f)
    metadata["files"][name] = _crc(path)
    with open(meta_path, "w") as f:
        json.dump(metadata, f)
