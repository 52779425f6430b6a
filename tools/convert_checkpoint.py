"""Convert checkpoints: to and from Hugging Face (GPT-2, Llama, Qwen3, Mixtral, Qwen-MoE, Qwen3-MoE, DeepSeek-V3,
gpt-oss) and Megatron-LM, and to another tensor-parallel size.

    python tools/convert_checkpoint.py to-hf CKPT OUT_DIR [--dtype float32|float16|bfloat16] [--no-tokenizer]
    python tools/convert_checkpoint.py from-hf HF_DIR OUT_DIR [pretrain_gpt.py flags, e.g. --tp 2 --max-seq-len 512]
    python tools/convert_checkpoint.py reshard CKPT OUT --tp T
    python tools/convert_checkpoint.py from-megatron MEGATRON_DIR OUT_DIR [--finetune] [--no-optim] [flags]
    python tools/convert_checkpoint.py to-megatron CKPT OUT [--format legacy|torch_dist] [--tp N --pp M] [--no-optim]
        [--expert-model-parallel-size E] [--moe-grouped-gemm] [--transformer-impl local|transformer_engine]
        [--use-distributed-optimizer [--dp N] [--overlap-grad-reduce [--ddp-bucket-size B]] [--bf16]]

CKPT: a run's output folder (its ``latest`` step) or a ``step_N`` folder. ``to-hf`` writes
``config.json``, ``generation_config.json`` and ``model.safetensors``, loadable with
``LlamaForCausalLM.from_pretrained(OUT_DIR)`` when the checkpoint's model is Llama-shaped (rope, RMSNorm
and swiglu; ``Qwen3ForCausalLM`` with QK-norm), with ``MixtralForCausalLM.from_pretrained(OUT_DIR)`` when it is a
Llama-shaped mixture of experts (``Qwen2MoeForCausalLM`` with a shared expert, ``Qwen3MoeForCausalLM`` with QK-norm;
docs/moe.md says which), with ``DeepseekV3ForCausalLM`` when it has multi-latent attention (its multi-token
prediction layers stored as DeepSeek's checkpoints store them), with ``GptOssForCausalLM`` when it has gpt-oss's
sliding windows, sinks, quick GeGLU or YaRN (``megatron/checkpoint/hf/models.py`` decides), else with
``GPT2LMHeadModel.from_pretrained(OUT_DIR)``, and the run's tokenizer
(``tokenizer.json``, ``tokenizer_config.json``), so that ``transformers.pipeline("text-generation",
model=OUT_DIR)`` generates; the end-of-document id is the bos and eos id. ``from-hf`` reads ``config.json``
(a ``gpt2``, ``llama``, ``qwen3``, ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``deepseek_v3`` or ``gpt_oss``
model_type) and ``model.safetensors`` (or sharded safetensors, or ``pytorch_model.bin``) and writes
``OUT_DIR/step_0`` and ``OUT_DIR/latest``: weights only, step 0, for ``pretrain_gpt.py --load OUT_DIR``, with the
folder's tokenizer copied to ``OUT_DIR/tokenizer/`` and named in the checkpoint's config. ``reshard`` writes
``OUT/step_N`` with one file per tensor-parallel rank, every kind (masters and AdamW states) kept. ``from-megatron``
reads a Megatron-LM save folder (or an ``iter_N`` folder), legacy (any tp x pp) or torch_dist, the model's shape from
its saved ``args``, and writes ``OUT_DIR/step_N`` (its iteration and consumed samples, and its optimizer states when
saved: Adam's moments and step, the fp32 masters, the schedule's position; ``--no-optim``: the weights only);
``to-megatron`` writes Megatron-LM's folder (Megatron Core names, the AdamW states unless ``--no-optim``), legacy cut
for tp x pp (x ep: ``--expert-model-parallel-size``; grouped-GEMM experts with ``--moe-grouped-gemm``) or torch_dist
(docs/checkpoints.md, section 7). Exit status 2, with a one-line message, for a missing or
damaged checkpoint or a model that cannot be converted.

Each command holds ``OUT/run.lock`` while it runs (as a training run holds its ``--save`` folder's): a second
writer of the same folder is refused in one line naming the first one's pid and command. A write that fails (a
full disk) is one line, exit status 2, and leaves nothing: files are written at private temporary names and
renamed when all are complete, and a folder the command created is removed again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron import file_lock  # noqa: E402
from megatron.checkpoint import CheckpointError, foreign_numbers  # noqa: E402
from megatron.checkpoint.convert import (  # noqa: E402
    check_apart,
    open_checkpoint,
    output_folder,
    read_tensors,
    reshard,
    write_params,
    writes_into,
)
from megatron.checkpoint.converted_config import ToolError, model_base, shaped_config  # noqa: E402
from megatron.checkpoint.format import file_inside  # noqa: E402
from megatron.checkpoint.hf.common import (  # noqa: E402
    ConversionError,
    export_tokenizer,
    find_hf_tokenizer,
    generation_config,
)
from megatron.checkpoint.hf.config_checks import read_hf_config  # noqa: E402
from megatron.checkpoint.hf.models import converter_for_hf, converter_for_model  # noqa: E402
from megatron.checkpoint.megatron_lm import distrib_optim as distrib  # noqa: E402
from megatron.checkpoint.megatron_lm.commands import from_megatron, to_megatron  # noqa: E402
from megatron.config import Config, ConfigError, parse_config  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES, TokenizerError, build_tokenizer  # noqa: E402

PROG = "convert_checkpoint.py"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _write_staged(out_dir: str, files: dict[str, object]) -> None:
    """Write ``files`` (name -> bytes, or a function writing the file at the path it is given) into ``out_dir``:
    each at a private temporary name first, then all renamed (``file_lock.Staged``). A failed write is one line
    (``writes_into``) and leaves none of them, the folder's earlier files unchanged."""
    with file_lock.Staged() as staged:
        with writes_into(out_dir):
            for name, content in files.items():
                path = os.path.join(out_dir, name)
                if isinstance(content, bytes):
                    staged.data(path, content)
                else:
                    staged.file(path, content)
        staged.commit()


def to_hf(ckpt: str, out_dir: str, dtype: str = "float32", tokenizer: bool = True,
          tokenizer_args: dict | None = None) -> None:
    """Write the Hugging Face folder of ``ckpt``; ``tokenizer_args`` (``tokenizer_type``, ``vocab_file``,
    ``merge_file``, ``tokenizer_model``, None for unset) replace the checkpoint's tokenizer settings."""
    from safetensors.torch import save_file

    reader, common, config = open_checkpoint(ckpt)
    hf = converter_for_model(config.model)
    section = config.tokenizer
    for name, value in (tokenizer_args or {}).items():
        if value is not None:
            setattr(section, name, value)
    # the tokenizer first: a file that cannot be found stops the tool before anything is written
    export = (export_tokenizer(section, config.model.vocab_size, reader.step_dir, config.model.max_position_embeddings)
              if tokenizer else None)
    family = hf.FAMILY  # what the family's checkpoints hold, and how it is written
    tensors = read_tensors(reader)
    if config.model.mtp_num_layers and not family.holds_mtp:  # only some families' checkpoints hold MTP modules
        tensors = {name: t for name, t in tensors.items() if not name.startswith("mtp.")}
        print(f"the {config.model.mtp_num_layers} multi-token prediction module(s) are not exported: "
              f"{hf.hf_config(config.model, dtype)['architectures'][0]} has no place for them (the model's logits "
              f"do not use them).")
    state = {name: t if family.keeps_fp32 and name.endswith(family.keeps_fp32) else t.to(DTYPES[dtype])
             for name, t in hf.to_hf_state_dict(tensors, config.model, common.get("train_state")).items()}
    hf_cfg = hf.hf_config(config.model, dtype)
    hf_cfg.update(export.token_ids if export is not None else {})
    os.makedirs(out_dir, exist_ok=True)
    # config.json last: a folder that has it has the rest
    _write_staged(out_dir, {"model.safetensors": lambda tmp: save_file(state, tmp, metadata={"format": "pt"}),
                            "generation_config.json": _json_bytes(generation_config(hf_cfg)),
                            **(export.files if export is not None else {}), "config.json": _json_bytes(hf_cfg)})
    written = ["config.json", "generation_config.json", "model.safetensors",
               *(export.files if export is not None else {})]
    print(f"wrote {out_dir}: {', '.join(written)} ({hf_cfg['architectures'][0]}) from {reader.step_dir} "
          f"(step {common['step']}, {sum(t.numel() for t in state.values()):,} parameters, {dtype})")
    if export is None:
        print("the tokenizer is not exported (--no-tokenizer): give generate() the eos id and load a tokenizer "
              "from elsewhere.")
    else:
        if export.files:
            print(f"tokenizer: {export.tokenizer_type}, end-of-document id {export.token_ids['eos_token_id']} "
                  f"(bos and eos); generate with transformers.pipeline('text-generation', model={out_dir!r})")
        for line in export.notes:
            print(line)
        for line in export.warnings:
            print(f"{PROG}: warning: {line}", file=sys.stderr)


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


@foreign_numbers.checked_hf_weights  # each weight floating-point and finite, else one line naming it
def read_hf_state_dict(hf_dir: str) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face model folder: model.safetensors, sharded safetensors, or pytorch_model.bin."""
    from safetensors.torch import load_file

    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    legacy = os.path.join(hf_dir, "pytorch_model.bin")
    try:
        if os.path.isfile(single):
            return load_file(single)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            paths = [file_inside(hf_dir, name, index) for name in files]  # never a file outside the folder
            state = {}
            for path in paths:
                state.update(load_file(path))
            return state
        if os.path.isfile(legacy):
            return torch.load(legacy, map_location="cpu", weights_only=True)
    except CheckpointError as err:
        raise ToolError(str(err)) from err
    except Exception as err:
        raise ToolError(f"cannot read the weights in {hf_dir} ({type(err).__name__}: {err}).") from err
    raise ToolError(f"no weights in {hf_dir}: expected model.safetensors, model.safetensors.index.json or "
                    f"pytorch_model.bin.")


def hf_to_config(hf_cfg: dict, flags: list[str]) -> Config:
    """Our resolved config for a Hugging Face config.json (``converter_for_hf``: GPT-2, Llama, Qwen3, Mixtral,
    Qwen-MoE, Qwen3-MoE, DeepSeek-V3, gpt-oss), with
    pretrain_gpt.py ``flags`` on top (any flag but the model's shape and architecture; vocab_size may only grow)."""
    derived = converter_for_hf(hf_cfg).model_flags(hf_cfg)
    n_positions = int(derived[derived.index("--max-position-embeddings") + 1])
    return shaped_config([*derived, "--max-seq-len", str(min(1024, n_positions))], flags, "config.json")


def from_hf(hf_dir: str, out_dir: str, flags: list[str], force: bool = False) -> None:
    # bounded, typed and unambiguous, as transformers reads it, before anything is built from it
    hf_cfg = read_hf_config(os.path.join(hf_dir, "config.json"))
    found = _hf_tokenizer(hf_dir, hf_cfg, flags)
    # validated with the tokenizer's files where they are; the checkpoint then names their copies
    config = hf_to_config(hf_cfg, [*flags, *_tokenizer_flags(found, hf_dir)])
    state = read_hf_state_dict(hf_dir)
    family = converter_for_hf(hf_cfg).FAMILY
    if family.mtp_layers_in and family.mtp_layers_in(state, hf_cfg) != (config.model.mtp_num_layers or 0):
        print(f"{hf_dir}: config.json names {config.model.mtp_num_layers} multi-token prediction layer(s) but the "
              f"weights hold none (model.layers.{hf_cfg['num_hidden_layers']}.*): the model is imported without them")
        hf_cfg = {**hf_cfg, "num_nextn_predict_layers": 0}
        config = hf_to_config(hf_cfg, [*flags, *_tokenizer_flags(found, hf_dir)])
    # A vocab_size above the model's (flag) adds rows that start at zero, like the padding rows.
    as_saved = dataclasses.replace(config.model, vocab_size=int(hf_cfg["vocab_size"]))
    # the family's options (DeepSeek-V3's rotary layout) and train state (its expert biases: not parameters)
    params = family.from_hf_state_dict(state, as_saved, config.padded_vocab_size, **family.options(hf_cfg))
    train_state = family.train_state(state, as_saved)
    tokenizer_dir = os.path.abspath(os.path.join(out_dir, "tokenizer"))
    if found is not None:
        for name in ("vocab_file", "merge_file", "tokenizer_model"):
            if found[0].get(name):
                setattr(config.tokenizer, name, os.path.join(tokenizer_dir, found[0][name]))
    # A run loading the checkpoint takes its config.yaml as its base: only the model, which config.json
    # fixes, and its tokenizer; the schedule, batch sizes and data are that run's own (derived from its
    # flags, not pinned here).
    with file_lock.Staged() as staged:  # the tokenizer's files written first, renamed after the checkpoint's
        if found is not None:
            with writes_into(out_dir):
                _stage_tokenizer(staged, tokenizer_dir, found[1])
        step_dir = write_params(out_dir, config, params, tp=config.distributed.mp_degree, converted_by="from-hf",
                                force=force, resume_config=model_base(config), train_state=train_state)
        staged.commit()
    print(f"wrote {step_dir} ({sum(t.numel() for t in params.values()):,} parameters, padded vocabulary "
          f"{config.padded_vocab_size}); continue pretraining with: pretrain_gpt.py ... --load {out_dir}")
    if found is not None:
        print(f"tokenizer: {found[0]['tokenizer_type']} from {hf_dir}, copied to {tokenizer_dir} and named in the "
              f"checkpoint's config (tools/generate.py --load {out_dir} needs no tokenizer flags)")


def _stage_tokenizer(staged: file_lock.Staged, tokenizer_dir: str, files: dict[str, str]) -> None:
    """Copies of the tokenizer ``files`` (name -> source path) staged for ``tokenizer_dir``: a new folder renamed
    whole, or, where an earlier import made it, each file renamed over its own."""
    if os.path.isdir(tokenizer_dir):
        for name, source in files.items():
            staged.file(os.path.join(tokenizer_dir, name), lambda tmp, source=source: shutil.copyfile(source, tmp))
        return
    folder = staged.folder(tokenizer_dir)
    for name, source in files.items():
        shutil.copyfile(source, os.path.join(folder, name))


def _hf_tokenizer(hf_dir: str, hf_cfg: dict, flags: list[str]) -> tuple[dict, dict[str, str]] | None:
    """The tokenizer of ``hf_dir`` (``find_hf_tokenizer``), if ``flags`` name none and ours can load it;
    a line says why not otherwise."""
    try:
        given = parse_config(flags).tokenizer
    except ConfigError:
        return None  # hf_to_config reports it
    if any(getattr(given, name) for name in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")):
        return None  # the flags name the tokenizer
    found = find_hf_tokenizer(hf_dir, hf_cfg)
    if found is None:
        print(f"{hf_dir} holds no tokenizer (tokenizer.json, vocab.json + merges.txt, or tokenizer.model): the "
              f"checkpoint names none; give --tokenizer-type and its files to name one.")
        return None
    settings = found[0]
    try:
        tokenizer = build_tokenizer(settings["tokenizer_type"], **{
            name: os.path.join(hf_dir, settings[name]) for name in ("vocab_file", "merge_file", "tokenizer_model")
            if settings.get(name)}, eod_token=settings.get("eod_token"))
        if tokenizer.vocab_size > int(hf_cfg.get("vocab_size") or 0):
            raise TokenizerError(f"it has {tokenizer.vocab_size} tokens, more than the model's vocab_size "
                                 f"{hf_cfg.get('vocab_size')}")
    except TokenizerError as err:
        print(f"{PROG}: warning: the tokenizer in {hf_dir} is not imported ({str(err).rstrip('.')}); give "
              f"--tokenizer-type and its files to name one.", file=sys.stderr)
        return None
    return found


def _tokenizer_flags(found: tuple[dict, dict[str, str]] | None, folder: str) -> list[str]:
    """Our flags for the settings of ``find_hf_tokenizer``, file names under ``folder``."""
    if found is None:
        return []
    flags = []
    for name, value in found[0].items():
        if value is not None:
            is_file = name in ("vocab_file", "merge_file", "tokenizer_model")
            flags += ["--" + name.replace("_", "-"), os.path.join(folder, value) if is_file else value]
    return flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", allow_abbrev=False,
                       help="Write a Hugging Face Llama or Qwen3 (a rope + RMSNorm + swiglu model), Mixtral, Qwen-MoE "
                            "or Qwen3-MoE (such a model with experts), DeepSeek-V3 (multi-latent attention), gpt-oss "
                            "(sliding windows, sinks, quick GeGLU) or GPT-2 folder (config.json, model.safetensors and "
                            "the run's tokenizer).")
    p.add_argument("ckpt", help="A run's output folder (its latest step) or a step_N folder.")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="Dtype of the written weights.")
    p.add_argument("--no-tokenizer", dest="tokenizer", action="store_false",
                   help="Write the model only, without the run's tokenizer files (and no bos/eos ids).")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="Tokenizer to export (default: the one the checkpoint's config names).")
    p.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json, where the config's is not found.")
    p.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt, where the config's is not found.")
    p.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model, Hugging Face tokenizer.json or tiktoken vocabulary, where the "
                        "config's is not found.")
    p = sub.add_parser("from-hf", allow_abbrev=False,
                       help="Write a checkpoint of ours (step 0, weights only) from a Hugging Face GPT-2, Llama, "
                            "Qwen3, Mixtral, Qwen-MoE, Qwen3-MoE, DeepSeek-V3 or gpt-oss folder; further arguments "
                            "are pretrain_gpt.py flags.")
    p.add_argument("hf_dir")
    p.add_argument("out_dir", help="Run folder to write: OUT_DIR/step_0 and OUT_DIR/latest.")
    p.add_argument("--force", action="store_true", help="Replace OUT_DIR/step_0 if it exists.")
    p = sub.add_parser("from-megatron", allow_abbrev=False,
                       help="Write a checkpoint of ours (the saved iteration, the weights and the optimizer states) "
                            "from a Megatron-LM checkpoint (legacy, any tp x pp, or torch_dist); further arguments are "
                            "pretrain_gpt.py flags.")
    p.add_argument("megatron_dir", help="Megatron-LM's save folder (its latest_checkpointed_iteration.txt) or an "
                                        "iter_N folder.")
    p.add_argument("out_dir", help="Run folder to write: OUT_DIR/step_N and OUT_DIR/latest.")
    p.add_argument("--force", action="store_true", help="Replace OUT_DIR/step_N if it exists.")
    p.add_argument("--finetune", action="store_true",
                   help="Write step 0 with no consumed samples (Megatron's --finetune): a new run from the weights.")
    p.add_argument("--no-optim", dest="optim", action="store_false",
                   help="Convert the weights only, not the optimizer states (the run continues with a fresh AdamW, "
                        "as Megatron's --no-load-optim).")
    p = sub.add_parser("to-megatron", allow_abbrev=False,
                       help="Write a Megatron-LM checkpoint (Megatron Core GPTModel names, the AdamW states) cut for "
                            "--tp x --pp ranks.")
    p.add_argument("ckpt", help="A run's output folder (its latest step) or a step_N folder.")
    p.add_argument("out", help="Megatron-LM save folder to write: OUT/iter_N, OUT/latest_checkpointed_iteration.txt.")
    p.add_argument("--format", dest="fmt", choices=("legacy", "torch_dist"), default="legacy",
                   help="legacy: mp_rank_*/model_optim_rng.pt files (--ckpt-format torch); torch_dist: a PyTorch "
                        "distributed-checkpoint folder (--ckpt-format torch_dist).")
    p.add_argument("--tp", type=int, default=1, help="Megatron's tensor-parallel size.")
    p.add_argument("--pp", type=int, default=1, help="Megatron's pipeline-parallel size.")
    p.add_argument("--no-optim", dest="optim", action="store_false",
                   help="Leave the AdamW states out (load the export in Megatron-LM with --no-load-optim).")
    p.add_argument("--expert-model-parallel-size", dest="ep", type=int, default=1,
                   help="Megatron's expert parallelism (legacy: rank files mp_rank_TT[_PPP]_EEE; the weights only).")
    p.add_argument("--moe-grouped-gemm", dest="grouped", action="store_true",
                   help="For a run with --moe-grouped-gemm: legacy files name the experts as TEGroupedMLP does "
                        "(GroupedMLP: --transformer-impl local or --moe-use-legacy-grouped-gemm; the weights only).")
    p.add_argument("--moe-use-legacy-grouped-gemm", dest="legacy_grouped", action="store_true",
                   help="Grouped GEMM by Megatron Core's legacy GroupedMLP (weight1 / weight2).")
    p.add_argument("--transformer-impl", dest="impl", choices=("local", "transformer_engine"), default=None,
                   help="The Megatron run's spec, whose names legacy files take; default transformer_engine with "
                        "--moe-grouped-gemm, else local.")
    distrib.add_export_flags(p)
    p = sub.add_parser("reshard", allow_abbrev=False,
                       help="Rewrite a checkpoint with one file per tensor-parallel rank.")
    p.add_argument("ckpt", help="A run's output folder (its latest step) or a step_N folder.")
    p.add_argument("out", help="Run folder to write: OUT/step_N (the same step) and OUT/latest.")
    p.add_argument("--tp", type=int, required=True, help="Tensor-parallel size of the written checkpoint.")
    p.add_argument("--force", action="store_true", help="Replace OUT/step_N if it exists.")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("from-hf", "from-megatron"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    out = args.out_dir if args.command in ("to-hf", "from-hf", "from-megatron") else args.out
    source = {"from-hf": "hf_dir", "from-megatron": "megatron_dir"}.get(args.command, "ckpt")
    try:
        check_apart(out, getattr(args, source))
        # one writer of the output folder at a time, before anything is written there (a second one: one line)
        with output_folder(out, shlex.join([PROG, *argv])) as warning:
            if warning:
                print(f"{PROG}: warning: {warning}", file=sys.stderr)
            _run(args, rest)
    except (ToolError, CheckpointError, ConversionError, ConfigError, TokenizerError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace, rest: list[str]) -> None:
    if args.command == "to-hf":
        to_hf(args.ckpt, args.out_dir, args.dtype, args.tokenizer,
              {name: getattr(args, name) for name in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")})
    elif args.command == "from-hf":
        from_hf(args.hf_dir, args.out_dir, rest, args.force)
    elif args.command == "from-megatron":
        from_megatron(args.megatron_dir, args.out_dir, rest, args.force, args.finetune, args.optim)
    elif args.command == "to-megatron":
        to_megatron(args.ckpt, args.out, args.fmt, args.tp, args.pp, args.optim, args.ep, args.grouped, args.impl,
                    args.legacy_grouped, distrib.export_options(args))
    else:
        step_dir = reshard(args.ckpt, args.out, args.tp, args.force)
        print(f"wrote {step_dir} with {args.tp} rank file(s), the vocabulary padded for --tp {args.tp}")


if __name__ == "__main__":
    sys.exit(main())
