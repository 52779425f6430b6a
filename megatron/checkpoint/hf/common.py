"""What the Hugging Face mappings (``hf_gpt2``, ``hf_llama``) share: the error, the name check, the
vocabulary padding rows, turning derived config values into our command-line flags, and the run's
tokenizer in Hugging Face's form (``export_tokenizer``) and back (``find_hf_tokenizer``)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import tokenizers
import torch
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from megatron.checkpoint.tokenizer_files import locate


class ConversionError(ValueError):
    """A state dict or configuration that does not describe our GPT (the message says what differs)."""


def check_names(got: set[str], want: set[str], what: str, hint: str = "check num_layers") -> None:
    """ConversionError naming the first missing and the first unexpected tensor, if any."""
    missing, extra = sorted(want - got), sorted(got - want)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} (first {missing[0]!r})")
        if extra:
            parts.append(f"unexpected {len(extra)} (first {extra[0]!r})")
        raise ConversionError(f"{what} does not match the model configuration: {', '.join(parts)}; {hint}.")


def layer_pattern(layers: int, keep) -> list:
    """``[keep(0), keep(1), ..., keep(layers - 1)]``: a per-layer pattern a config.json describes by a rule."""
    return list(map(keep, range(layers)))


def unpad_vocab(t: torch.Tensor, vocab: int, name: str) -> torch.Tensor:
    """The first ``vocab`` rows of a ``[padded_vocab, h]`` tensor (the padding rows are dropped)."""
    if t.shape[0] < vocab:
        raise ConversionError(f"{name} has {t.shape[0]} rows, fewer than vocab_size {vocab}.")
    return t[:vocab]


def pad_vocab(t: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """``[V, h]`` -> ``[padded_vocab, h]``, the added rows zero."""
    return torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])


def check_vocab_shape(t: torch.Tensor, name: str, vocab: int, hidden: int, padded_vocab: int) -> None:
    if tuple(t.shape) != (vocab, hidden):
        raise ConversionError(f"{name} has shape {list(t.shape)}, expected [{vocab}, {hidden}] "
                              f"(vocab_size, hidden_size).")
    if padded_vocab < vocab:
        raise ConversionError(f"padded_vocab ({padded_vocab}) is smaller than vocab_size ({vocab}).")


def to_flags(values: dict) -> list[str]:
    """``{"hidden_size": 64, "swiglu": True, "untie_...": False}`` -> ``["--hidden-size", "64", "--swiglu"]``
    (a True boolean is its bare flag, a False one is left out: every boolean model flag defaults to off)."""
    flags = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


# ---------------------------------------------------------------- the tokenizer, both ways

# Text the exported tokenizer must encode to the same ids as ours (spaces, tabs, newlines, digits,
# punctuation, accents, CJK and emoji: the places where tokenizer pipelines differ).
SAMPLE_TEXT = ("Hello world! The cat sat on the mat.\n\n  Two  spaces,\ta tab; numbers 12345 and 3.14 - it's "
               "we'll CamelCase HTTPServer x2y\r\ncafé naïve 東京 день 😀🚀 end")
# Our tokenizer section's file fields, and the flag each is given by.
_FILE_FLAGS = {"vocab_file": "--vocab-file", "merge_file": "--merge-file", "tokenizer_model": "--tokenizer-model"}
_SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


@dataclass
class TokenizerExport:
    """What ``to-hf`` writes for the run's tokenizer (of ``tokenizer_type``, None when the run names
    none): ``files`` (name -> bytes, next to config.json),
    ``token_ids`` (``bos_token_id`` and ``eos_token_id``: the end-of-document id, for config.json and
    generation_config.json), one-line ``notes`` and ``warnings`` for the user."""

    tokenizer_type: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    token_ids: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def resolve_tokenizer_section(section, step_dir: str):
    """A copy of the ``tokenizer:`` section with every file it names found (``locate``); ConversionError
    naming the flag for a file found nowhere."""
    from megatron.config import infer_tokenizer_type

    section = dataclasses.replace(section)
    infer_tokenizer_type(section)
    used = {None: (), "NullTokenizer": (), "GPT2BPETokenizer": ("vocab_file", "merge_file")}.get(
        section.tokenizer_type, ("tokenizer_model",))
    for name in used:
        value, flag = getattr(section, name), _FILE_FLAGS[name]
        if not value:
            continue  # the tokenizer says it is missing
        found = locate(str(value), step_dir)
        if found is None:
            raise ConversionError(f"the tokenizer's {flag} {value} is not found (as given, or under the folders "
                                  f"of {step_dir}); give it with {flag} PATH, or pass --no-tokenizer to export "
                                  f"the model without its tokenizer.")
        setattr(section, name, found)
    return section


def generation_config(hf_cfg: dict) -> dict:
    """``generation_config.json`` of an export: the bos, eos and pad ids (pad: the end-of-document id), and no
    length, as Hugging Face's own GPT-2 and Llama files: with ``max_length`` there transformers warns at every
    ``generate(max_new_tokens=N)``; with ``max_new_tokens`` there it overrides every caller's ``max_length`` (lm-eval's
    ``hf`` backend passes one), changing what they generate. A caller gives the length; a model with learned
    positions cannot generate past them."""
    eos = hf_cfg["eos_token_id"]
    return {"bos_token_id": hf_cfg["bos_token_id"], "eos_token_id": eos, **({"pad_token_id": eos} if eos is not None
                                                                             else {})}


def export_tokenizer(section, vocab_size: int, step_dir: str, max_length: int) -> TokenizerExport:
    """The run's tokenizer (its config's ``tokenizer:`` section) as Hugging Face files that
    ``AutoTokenizer.from_pretrained`` loads with no custom code: ``tokenizer.json`` (encoding as ours,
    the end-of-document token as its special bos and eos token, no BOS/EOS added to the text) and
    ``tokenizer_config.json``, plus the original files (``vocab.json`` / ``merges.txt``,
    ``tokenizer.model``). ConversionError / TokenizerError when the named files are missing or unusable."""
    from megatron.tokenizer import configured_tokenizer

    section = resolve_tokenizer_section(section, step_dir)
    kind = section.tokenizer_type
    out = TokenizerExport(tokenizer_type=kind)
    if kind is None:
        out.notes.append("the checkpoint names no tokenizer (it was trained on synthetic data): no tokenizer files "
                         "are written; pass --tokenizer-type and its files to include one.")
        return out
    tokenizer = configured_tokenizer(section, vocab_size)
    if tokenizer.vocab_size > vocab_size:
        raise ConversionError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {vocab_size}; "
                              f"give the tokenizer the model was trained with.")
    out.token_ids = {"bos_token_id": tokenizer.eod, "eos_token_id": tokenizer.eod}
    if kind == "NullTokenizer":
        out.notes.append(f"NullTokenizer: the run read token ids, so there is no text tokenizer to export; "
                         f"config.json names the end-of-document id {tokenizer.eod} as bos and eos.")
        return out
    try:
        backend, originals, unk = _backend(tokenizer, kind, section)
    except (ImportError, ValueError) as err:
        out.warnings.append(f"the {kind} is not exported ({err}); config.json names its end-of-document id "
                            f"{tokenizer.eod} as bos and eos, load the tokenizer from its own files.")
        return out
    if backend.post_processor is not None and (backend.encode(SAMPLE_TEXT).ids
                                               != backend.encode(SAMPLE_TEXT, add_special_tokens=False).ids):
        backend.post_processor = None
        out.notes.append("the tokenizer.json's post-processor, which adds special tokens, is left out: the model "
                         "was trained on text encoded without them.")
    eod_token = backend.id_to_token(tokenizer.eod)
    backend.add_special_tokens([tokenizers.AddedToken(eod_token, special=True, normalized=False)])
    text = backend.to_str(pretty=True)
    ours, theirs = tokenizer.tokenize(SAMPLE_TEXT), tokenizers.Tokenizer.from_str(text).encode(SAMPLE_TEXT).ids
    if ours != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        out.warnings.append(f"the exported tokenizer encodes a sample text to other ids than the run's {kind} "
                            f"(from token {first} on); check it before use, or pass --no-tokenizer.")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eod_token, "eos_token": eod_token,
                **({"unk_token": unk} if unk else {}), "add_bos_token": False, "add_eos_token": False,
                "clean_up_tokenization_spaces": False, "model_max_length": max_length}
    out.files = {**originals, "tokenizer.json": text.encode(),
                 "tokenizer_config.json": (json.dumps(settings, indent=2, ensure_ascii=False) + "\n").encode()}
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _backend(tokenizer, kind: str, section) -> tuple[tokenizers.Tokenizer, dict[str, bytes], str | None]:
    """(a ``tokenizers.Tokenizer`` that encodes as ``tokenizer``, the original files to keep, the unknown
    token or None)."""
    if kind in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
        backend = tokenizers.Tokenizer.from_str(tokenizer._tok.to_str())  # a copy, truncation and padding off
        files = ({"vocab.json": _read(section.vocab_file), "merges.txt": _read(section.merge_file)}
                 if kind == "GPT2BPETokenizer" else {})
        return backend, files, None
    if kind in _SENTENCEPIECE:
        backend, unk = sentencepiece_backend(tokenizer.model_file)
        return backend, {"tokenizer.model": _read(tokenizer.model_file)}, unk
    if kind == "TikTokenizer":
        return tiktoken_backend(tokenizer), {}, None
    raise ValueError(f"no Hugging Face form is known for {kind}")


def sentencepiece_backend(model_file: str) -> tuple[tokenizers.Tokenizer, str | None]:
    """A SentencePiece ``.model`` (unigram or BPE) as a ``tokenizers.Tokenizer`` that encodes as
    ``SentencePieceProcessor.encode``: its normalization (precompiled rules, extra whitespace removed,
    the dummy ``▁`` prefix, spaces as ``▁``), its pieces and scores (BPE: every split of a piece into two
    pieces is a merge of that piece's rank), byte fallback; control pieces are special tokens.
    Returns (tokenizer, the unknown piece)."""
    from sentencepiece import sentencepiece_model_pb2  # needs protobuf

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(_read(model_file))
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    normal, unknown, control, user = 1, 2, 3, 4  # ModelProto.SentencePiece.Type
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk = next((i for i, p in enumerate(pieces) if p[2] == unknown), None)
    if spec.model_type == 1:  # unigram
        model = models.Unigram([(p, s) for p, s, _ in pieces], unk, spec.byte_fallback)
    elif spec.model_type == 2:  # BPE
        mergeable = {p: i for i, (p, _, t) in enumerate(pieces) if t == normal}
        merges = sorted((rank, mergeable[piece[:i]], piece[:i], piece[i:]) for piece, rank in mergeable.items()
                        for i in range(1, len(piece)) if piece[:i] in mergeable and piece[i:] in mergeable)
        model = models.BPE({p: i for i, (p, _, _) in enumerate(pieces)}, [(a, b) for _, _, a, b in merges],
                           unk_token=None if unk is None else pieces[unk][0], fuse_unk=True,
                           byte_fallback=spec.byte_fallback)
    else:
        raise ValueError(f"SentencePiece model type {spec.model_type} is neither unigram nor BPE")
    backend = tokenizers.Tokenizer(model)
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "),
                                         *([decoders.ByteFallback()] if spec.byte_fallback else []), decoders.Fuse(),
                                         *([decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else [])])
    backend.add_tokens([tokenizers.AddedToken(p, special=False, normalized=False) for p, _, t in pieces if t == user])
    backend.add_special_tokens([tokenizers.AddedToken(p, special=True, normalized=False)
                                for p, _, t in pieces if t == control])
    return backend, None if unk is None else pieces[unk][0]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies are written in it)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def tiktoken_backend(tokenizer) -> tokenizers.Tokenizer:
    """Our ``TikTokenizer`` as a byte-level BPE ``tokenizers.Tokenizer`` with the same ids: the reserved
    special tokens first, the ranks after them, every split of a token into two tokens a merge of that
    token's rank, whole pre-tokenized pieces in the vocabulary taken as they are (as tiktoken does)."""
    from megatron.tokenizer.tik import PATTERNS, SPECIAL_TOKENS, _read_ranks

    specials = [*SPECIAL_TOKENS, *(f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), tokenizer.num_special_tokens))]
    ranks = _read_ranks(tokenizer.vocab_file, tokenizer.vocab_size - len(specials), len(specials))
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {**{t: i for i, t in enumerate(specials)}, **{text(b): rank for b, rank in ranks.items()}}
    merges = sorted((rank, ranks[b[:i]], ranks[b[i:]], text(b[:i]), text(b[i:])) for b, rank in ranks.items()
                    for i in range(1, len(b)) if b[:i] in ranks and b[i:] in ranks)
    backend = tokenizers.Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in merges], ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERNS[tokenizer.pattern]), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])
    return backend


def find_hf_tokenizer(hf_dir: str, hf_cfg: dict) -> tuple[dict, dict[str, str]] | None:
    """The tokenizer of a Hugging Face model folder, as our ``tokenizer:`` settings and the files to copy:
    ``({"tokenizer_type": ..., field: file name, "eod_token": ...}, {file name: source path})``, file
    names relative to where they will be copied; None when the folder holds none. ``tokenizer.json``
    (HuggingFaceTokenizer, eod its eos token) is preferred, then GPT-2's ``vocab.json`` + ``merges.txt``
    (GPT2BPETokenizer), then a SentencePiece ``tokenizer.model`` (SentencePieceTokenizer)."""
    def have(name: str) -> str | None:
        path = os.path.join(hf_dir, name)
        return path if os.path.isfile(path) else None

    if have("tokenizer.json"):
        return ({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "tokenizer.json",
                 "eod_token": _hf_eos_token(hf_dir, hf_cfg, have("tokenizer.json"))},
                {"tokenizer.json": have("tokenizer.json")})
    if have("vocab.json") and have("merges.txt"):
        return ({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "vocab.json", "merge_file": "merges.txt"},
                {"vocab.json": have("vocab.json"), "merges.txt": have("merges.txt")})
    if have("tokenizer.model"):
        return ({"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "tokenizer.model"},
                {"tokenizer.model": have("tokenizer.model")})
    return None


def _hf_eos_token(hf_dir: str, hf_cfg: dict, tokenizer_json: str) -> str | None:
    """The eos token of a Hugging Face folder: tokenizer_config.json's or special_tokens_map.json's
    ``eos_token``, else the token of generation_config.json's or config.json's ``eos_token_id`` (the
    first, for a list); None when none is named."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        settings = _json(os.path.join(hf_dir, name))
        eos = settings.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and eos:
            return eos
    for settings in (_json(os.path.join(hf_dir, "generation_config.json")), hf_cfg):
        eos_id = settings.get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
        if isinstance(eos_id, int):
            try:
                return tokenizers.Tokenizer.from_file(tokenizer_json).id_to_token(eos_id)
            except Exception:  # an unreadable tokenizer.json is reported when it is loaded
                return None
    return None


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
