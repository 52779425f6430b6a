"""What the generation tools share: the flags that say which model to load and how, and the engine
they build (``tools/generate.py``, ``tools/serve.py``)."""

from __future__ import annotations

import argparse
import os
import time

from megatron import cpu_threads
from megatron.checkpoint.run_dir import on_every_rank
from megatron.inference.engine import InferenceEngine
from megatron.inference.loader import DTYPES, collective_device, initialize, load_model, tokenizer_for, torch_device
from megatron.initialize import local_ranks
from megatron.tokenizer import TOKENIZER_TYPES


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--load", required=True, metavar="CKPT",
                   help="Checkpoint: a run's output folder (its latest step) or a step_N folder, of any layout.")
    g.add_argument("--tp", type=int, default=None,
                   help="Tensor-parallel size (default: the number of processes torchrun started).")
    g.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="The model's dtype.")
    g.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="Where the model runs.")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="Tokenizer (default: the one the run was trained with, from its saved config).")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json (with --tokenizer-type).")
    g.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt (with --tokenizer-type).")
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model or Hugging Face tokenizer.json (with --tokenizer-type).")


def build_engine(args: argparse.Namespace) -> InferenceEngine:
    """Join the tensor-parallel group, load the checkpoint and its tokenizer. ValueError (a
    CheckpointError, a TokenizerError) with a one-line message on a problem."""
    initialize(args.tp, args.device)
    device = torch_device(args.device)
    threads = cpu_threads.apply(None, local_ranks()) if device.type == "cpu" else None
    start = time.perf_counter()
    model, config = load_model(args.load, args.dtype, device)
    tokenizer = on_every_rank(lambda: _tokenizer(args, config), collective_device(device), "cannot load the tokenizer",
                              "give --tokenizer-type and its files")
    engine = InferenceEngine(model, config, tokenizer, device)
    engine.load_seconds = time.perf_counter() - start
    engine.threads = threads
    return engine


def _tokenizer(args: argparse.Namespace, config):
    tokenizer = tokenizer_for(config, args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model)
    if tokenizer is None:
        raise ValueError(f"{args.load} was trained without a tokenizer (synthetic data): give --tokenizer-type and "
                         f"its files.")
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {config.model.vocab_size}"
                         f": give the tokenizer the model was trained with.")
    return tokenizer


def describe(engine: InferenceEngine, path: str) -> str:
    m = engine.config.model
    return (f"loaded {os.path.normpath(path)}: {m.num_layers} layers, hidden {m.hidden_size}, "
            f"{m.max_position_embeddings} positions, vocabulary {m.vocab_size}, tp {engine.tp_size}, "
            f"{engine.dtype} on {engine.device}{_threads(engine)} ({engine.load_seconds:.1f} s)")


def _threads(engine: InferenceEngine) -> str:
    threads = getattr(engine, "threads", None)
    return f", {threads.describe()}" if threads else ""
