"""Describe a checkpoint: step, the layout it was saved under, the model, its tensors and their sizes.

    python tools/checkpoint_info.py CKPT [--tensors] [--verify]

CKPT: a run's output folder (its ``latest`` step) or a ``step_N`` folder. ``--tensors`` lists every
tensor with its global shape, tensor-parallel split and the kinds saved for it. ``--verify`` reads
the whole checkpoint and checks every checksum (every piece of every rank file, common.json,
config.yaml, the RNG files). Exit status 2, with a one-line message, for a missing or damaged
checkpoint (a checksum mismatch included).

CKPT may also be a Megatron-LM folder (its save folder with ``latest_checkpointed_iteration.txt``, or an ``iter_N``
folder; legacy or torch_dist): the format, iteration, the layout of its rank files, the model (its args), the
optimizer's states and their layout, the scheduler's state, and whether ``convert_checkpoint.py from-megatron``
converts it (``--verify``: by reading every tensor as the conversion does; ``megatron/checkpoint/megatron_lm/info.py``).
It is read by the converter's own readers and judged by the converter's own checks: a folder the converter refuses
is "converts: no" in its words, and a crafted one (a size or iteration out of range, a file linked from outside the
folder, a damaged index) is the converter's one line, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint.convert import open_checkpoint, tensor_layout  # noqa: E402
from megatron.checkpoint.format import KINDS, CheckpointError, CheckpointReader, resolve_checkpoint  # noqa: E402
from megatron.checkpoint.hf.common import ConversionError  # noqa: E402
from megatron.checkpoint.megatron_lm.info import describe as describe_megatron  # noqa: E402
from megatron.checkpoint.megatron_lm.info import is_megatron  # noqa: E402

PROG = "checkpoint_info.py"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _precision(config) -> str:
    mp = config.mix_precision
    if mp.bf16:
        return "bf16 (fp32 master weights)"
    if mp.use_pure_fp16:
        scaling = "dynamic" if mp.dynamic_loss_scale else "static"
        return f"fp16 (fp32 master weights, {scaling} loss scaling)"
    return "fp32"


def describe(path: str, tensors: bool = False) -> list[str]:
    reader, common, config = open_checkpoint(path)
    meta = reader.metadata
    pieces = meta["pieces"]
    layout = meta.get("layout", {})
    m, d = config.model, config.distributed
    state = common.get("train_state") or {}
    lines = [
        f"checkpoint: {reader.step_dir}",
        f"step: {common['step']} (consumed samples {state.get('consumed_samples', '?')}, skipped steps "
        f"{state.get('skipped_steps', '?')}, AdamW step {common.get('adam_step', 0):g}), "
        f"format version {meta.get('format_version', '?')}",
        "saved under: " + ", ".join(f"{k} {v}" for k, v in layout.items()),
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, ffn "
        f"{m.ffn_hidden_size}, vocab {m.vocab_size}, positions {m.max_position_embeddings}, layernorm eps "
        f"{m.layernorm_epsilon:g}",
        f"training config: precision {_precision(config)}, seq len {config.dataset.max_seq_len}, global batch "
        f"{config.batch_size.global_batch_size}, tp {d.mp_degree}, pp {d.pp_degree}, dp {d.dp_degree}, "
        f"sharding {d.sharding.sharding_degree} (stage {d.sharding.sharding_stage})",
    ]
    if common.get("grad_scaler"):
        lines.append(f"loss scaler: {common['grad_scaler']}")
    order = {name: i for i, name in enumerate(tensor_layout(config))}  # the model's order
    names = sorted(reader.names, key=lambda n: (order.get(n, len(order)), n))
    n_params = 0
    for name in names:
        count = 1
        for size in reader.global_shape(name):
            count *= size
        n_params += count
    lines.append(f"tensors: {len(names)}, parameters: {n_params:,} ({n_params / 1e6:.2f}M, padded vocabulary "
                 f"included)")
    reader.verify()  # every rank file holds every byte its pieces need
    elements: dict[str, int] = {}
    for piece in pieces:
        elements[piece["kind"]] = elements.get(piece["kind"], 0) + piece["hi"] - piece["lo"]
    for kind in sorted(elements, key=lambda k: KINDS.index(k) if k in KINDS else len(KINDS)):
        lines.append(f"  {kind}: {elements[kind]:,} elements, {_bytes(4 * elements[kind])} (float32)")
    ranks = sorted({piece["rank"] for piece in pieces})
    on_disk = sum(os.path.getsize(os.path.join(reader.step_dir, f)) for f in os.listdir(reader.step_dir)
                  if os.path.isfile(os.path.join(reader.step_dir, f)))
    lines.append(f"files: {len(ranks)} rank file(s) with tensors, {_bytes(on_disk)} on disk")
    if tensors:
        for name in names:
            kinds = [kind for kind in KINDS if reader.has(kind, name)]
            first = reader.index[("param", name)][0]
            split = "replicated" if first["partition_dim"] is None else (
                f"split along dim {first['partition_dim']} into {first['tp_size']}")
            lines.append(f"  {name}: {list(reader.global_shape(name))} {split} [{', '.join(kinds)}]")
    return lines


def verify(path: str) -> str:
    """Check every checksum of the checkpoint at ``path`` (CheckpointError at the first mismatch); the
    line to print."""
    reader = CheckpointReader(resolve_checkpoint(path))
    start = time.perf_counter()
    try:
        pieces, nbytes = reader.verify_all()
    finally:
        reader.close()
    if not reader.checksummed:
        return (f"checksums: none (format {reader.metadata['format_version']} has none); the rank files hold every "
                f"byte their {pieces} pieces need")
    seconds = time.perf_counter() - start
    files = len(reader.metadata.get("files") or {})
    return (f"checksums: all match ({pieces} pieces, {_bytes(nbytes)} of tensors, and {files} files; "
            f"{seconds:.2f} s, {nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="A run's output folder (its latest step) or a step_N folder; or a Megatron-LM "
                                     "save folder or iter_N folder.")
    parser.add_argument("--tensors", action="store_true", help="List every tensor's global shape.")
    parser.add_argument("--verify", action="store_true", help="Read everything and check every checksum.")
    args = parser.parse_args(argv)
    try:
        if is_megatron(args.ckpt):
            print("\n".join(describe_megatron(args.ckpt, args.verify)))
            return 0
        print("\n".join(describe(args.ckpt, args.tensors)), flush=True)
        if args.verify:
            print(verify(args.ckpt))
    except (CheckpointError, ConversionError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
