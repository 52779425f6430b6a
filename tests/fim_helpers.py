"""What the fill-in-the-middle tests share: the test corpus's GPT-2 BPE with StarCoder's FIM tokens added, and
Megatron-LM's own FIM dataset as a reference (its source, tests/fixtures/megatron_lm/, run on a given sample)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import shutil
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import megatron
from megatron.data.fim import FIMTokens
from megatron.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
FIM_TOKENS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")  # Megatron's defaults (StarCoder's)
FIXTURE = ROOT / "tests" / "fixtures" / "megatron_lm" / "fim_dataset.core_v0.16.1.py.txt"
FIXTURE_BLOB = "730b7e033a1963e22241950c94e14016f1acf6e6"  # its git blob at core_v0.16.1
HEADER_END = b"# " + b"-" * 106 + b"\n"


def gpt2_with_fim_tokens(corpus: Path, folder: Path) -> list[str]:
    """The tokenizer flags of the corpus's GPT-2 BPE (tests/functional/corpus.py) with the four FIM tokens appended
    to its vocab.json (ids V .. V + 3; ``<|endoftext|>`` stays V - 1), written in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((corpus / "tok" / "vocab.json").read_text())
    size = max(vocab.values()) + 1
    vocab.update({token: size + i for i, token in enumerate(FIM_TOKENS)})
    (folder / "vocab.json").write_text(json.dumps(vocab))
    shutil.copy(corpus / "tok" / "merges.txt", folder / "merges.txt")
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(folder / "vocab.json"), "--merge-file",
            str(folder / "merges.txt")]


def _megatron_source() -> bytes:
    """The fixture's Megatron-LM source, checked against the git blob it was copied from."""
    body = FIXTURE.read_bytes().split(HEADER_END, 1)[1]
    assert hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest() == FIXTURE_BLOB, "the fixture was changed"
    return body


@contextlib.contextmanager
def megatron_fim_dataset_class():
    """Megatron-LM's ``GPTFIMDataset`` (its source executed, its base classes megatron-core's, the test extra's),
    while the context lasts; the test is skipped without megatron-core 0.16.1."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core is not installed (pip install megatron-core==0.16.1 --no-deps: the test extra)")
    if version != "0.16.1":
        pytest.skip(f"megatron-core {version} is installed; the reference is pinned to 0.16.1")
    folder = str(Path(importlib.metadata.distribution("megatron-core").locate_file("megatron")))
    megatron.__path__.append(folder)  # our package shadows site-packages' megatron/core (megatron_core_reference)
    module = types.ModuleType("megatron_fim_reference")  # a module of its own: @dataclass looks it up
    sys.modules[module.__name__] = module
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron-core's notices about Apex and Transformer Engine
            exec(compile(_megatron_source(), "core_v0.16.1:megatron/training/datasets/fim_dataset.py", "exec"),
                 module.__dict__)
        yield module.GPTFIMDataset
    finally:
        del sys.modules[module.__name__]
        megatron.__path__.remove(folder)


def megatron_fim(cls, tokenizer: Tokenizer, tokens: FIMTokens, rate: float, spm_rate: float,
                 fragment_rate: float | None, no_prefix: str | None, seed: int) -> Callable[[np.ndarray], np.ndarray]:
    """``sample -> Megatron's FIM sample`` through its ``_query_document_sample_shuffle_indices`` (the sample as
    one document of its dataset), its attributes set as its ``__init__`` sets them (one ``RandomState(seed)``
    drawn from in the order of the calls), our tokenizer behind its ``_tokenizer`` interface."""
    ds = cls.__new__(cls)
    ds.np_rng = np.random.RandomState(seed=seed)
    ds.fim_rate, ds.fim_spm_rate, ds.fragment_fim_rate, ds.no_fim_prefix = rate, spm_rate, fragment_rate, no_prefix
    ds.fim_split_sample = tokens.split
    ds.prefix_tok_id, ds.middle_tok_id, ds.suffix_tok_id = tokens.prefix, tokens.middle, tokens.suffix
    ds.pad_tok_id, ds.eod_tok_id = tokens.pad, tokens.eod
    library = types.SimpleNamespace(ids_to_text=tokenizer.detokenize, text_to_ids=tokenizer.tokenize)
    ds.config = types.SimpleNamespace(tokenizer=types.SimpleNamespace(_tokenizer=library))

    def run(sample: np.ndarray) -> np.ndarray:
        ds.dataset = types.SimpleNamespace(get=lambda doc, offset=0, length=None: sample[offset:offset + length])
        ds.shuffle_index, ds.document_index = np.array([0]), np.array([0])
        ds.sample_index = np.array([[0, 0], [0, len(sample) - 1]])
        return ds._query_document_sample_shuffle_indices(0)[0]

    run.dataset = ds  # its RandomState: how far it was drawn
    return run
