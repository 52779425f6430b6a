"""Fill-in-the-middle (megatron/data/fim.py): the transform against samples worked out by hand from Megatron-LM's
fim_dataset.py (core_v0.16.1), with scripted draws; against Megatron's own code (tests/fim_helpers.py) on random
samples; one generator per sample (the same sample whatever reads it); the configuration's errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron.config import ConfigError, parse_config, validate
from megatron.data.fim import FIMDataset, FIMTokens, FIMTransform, fim_tokens, sample_rng, with_fim
from megatron.data.loader import build_loader
from megatron.tokenizer import Tokenizer, build_tokenizer
from megatron.tokenizer.base import as_id_list
from tests.fim_helpers import FIM_TOKENS, gpt2_with_fim_tokens, megatron_fim, megatron_fim_dataset_class

ALPHABET = "abcdefghijklmnopqrstuvwxyz|. "
SPECIALS = {"P": "<fim_prefix>", "M": "<fim_middle>", "S": "<fim_suffix>", "_": "<fim_pad>", "E": "<|endoftext|>"}


class CharTokenizer(Tokenizer):
    """One id per character of ALPHABET (a 0, b 1, ...), then the FIM tokens and the end of document."""

    def tokenize(self, text: str) -> list[int]:
        return [ALPHABET.index(c) for c in text]

    def detokenize(self, ids) -> str:
        names = list(SPECIALS.values())
        return "".join(ALPHABET[i] if i < len(ALPHABET) else names[i - len(ALPHABET)] for i in as_id_list(ids))

    def token_id(self, token: str) -> int | None:
        if len(token) == 1 and token in ALPHABET:
            return ALPHABET.index(token)
        names = list(SPECIALS.values())
        return len(ALPHABET) + names.index(token) if token in names else None

    @property
    def vocab_size(self) -> int:
        return len(ALPHABET) + len(SPECIALS)

    @property
    def eod(self) -> int:
        return self.token_id("<|endoftext|>")

    def _init_args(self) -> dict:
        return {}


CHARS = CharTokenizer()
TOKENS = FIMTokens(*(CHARS.token_id(SPECIALS[k]) for k in "PMS_E"), split=CHARS.token_id("|"))


def ids(text: str) -> list[int]:
    """'PaSbM' -> the ids: lower case and '|' are characters, P M S the sentinels, _ the pad, E end of document."""
    return [CHARS.token_id(SPECIALS.get(c, c)) for c in text]


class Script:
    """Draws given in advance, in Megatron's order; the calls recorded (("binomial", p), ("randint", low, high))."""

    def __init__(self, *draws):
        self.draws, self.calls = list(draws), []

    def binomial(self, n: int, p: float) -> int:
        assert n == 1
        self.calls.append(("binomial", p))
        return self.draws.pop(0)

    def randint(self, low: int, high: int, size: int) -> np.ndarray:
        assert size == 2
        self.calls.append(("randint", low, high))
        return np.array(self.draws.pop(0))


def fim(text: str, *draws, rate=0.5, spm=0.25, fragment=None, no_prefix=None, split=False):
    """(the FIM sample of ``text``, the draws asked for); every scripted draw must be used."""
    tokens = TOKENS if split else dataclasses.replace(TOKENS, split=None)
    script = Script(*draws)
    out = FIMTransform(CHARS, tokens, rate, spm, fragment, no_prefix)(np.array(ids(text)), script)
    assert not script.draws, "draws left over"
    assert out.dtype == np.int64 and len(out) == len(text)
    return out.tolist(), script.calls


def test_psm_and_spm_layouts():
    # "abcdef": FIM drawn; cuts randint -> [4, 1], sorted (1, 4): prefix "a", middle "bcd", suffix "ef"; then the
    # SPM draw. The EOD stays; the three empty documents between the EODs are dropped with their EODs; the empty
    # part after the last EOD draws its FIM (0). Length: 6 + 3 sentinels + 1 EOD = the 10 of the sample.
    psm, calls = fim("abcdefEEEE", 1, [4, 1], 0, 0)
    assert psm == ids("PaSefMbcdE")
    assert calls == [("binomial", 0.5), ("randint", 0, 7), ("binomial", 0.25), ("binomial", 0.5)]
    spm, _ = fim("abcdefEEEE", 1, [4, 1], 1, 0)
    assert spm == ids("PSefMabcdE")


def test_empty_pieces_and_the_empty_part_after_the_last_eod():
    assert fim("abcEEEE", 1, [0, 0], 0, 0)[0] == ids("PSabcME")  # empty prefix and middle
    assert fim("abcEEEE", 1, [3, 3], 1, 0)[0] == ids("PSMabcE")  # SPM, empty suffix and middle
    # the empty part after the last EOD, FIM drawn: the three sentinels alone (Megatron's loop)
    out, calls = fim("abEEEE", 0, 1, [0, 0], 0)
    assert out == ids("abEPSM") and calls[1:] == [("binomial", 0.5), ("randint", 0, 1), ("binomial", 0.25)]


def test_truncation_and_padding_back_to_the_sample_length():
    assert fim("abcdef", 1, [4, 1], 0)[0] == ids("PaSefM")  # 9 ids cut to 6: the end of the middle is lost
    assert fim("abcEdef", 1, [1, 2], 0, 0)[0] == ids("PaScMbE")  # cut at (1, 2); the second document cut off
    assert fim("abEEcd", 0, 0)[0] == ids("abEcd_")  # the empty document dropped with its EOD: padded
    assert fim("Eabc", 0)[0] == ids("abc_")  # a leading EOD is an empty document too


def test_fragments_on_the_split_token():
    # "ab|cd|": the document holds '|': FIM at fim_rate (1), then each fragment at the fragment rate: "ab" cut at
    # (1, 1) as PSM, "cd" left, the empty fragment after the last '|' drawn (0); the split tokens kept.
    out, calls = fim("ab|cd|EEEE", 1, 1, [1, 1], 0, 0, 0, 0, split=True, fragment=0.75)
    assert out == ids("PaSbM|cd|E")
    assert calls == [("binomial", 0.5), ("binomial", 0.75), ("randint", 0, 3), ("binomial", 0.25),
                     ("binomial", 0.75), ("binomial", 0.75), ("binomial", 0.5)]
    # the document-level draw says no: no fragment is drawn for
    assert fim("ab|cdE", 0, 0, split=True, fragment=0.75) == (ids("ab|cdE"), [("binomial", 0.5)] * 2)
    # an empty fragment is dropped with its split token (padded at the end); a document without '|': fim_rate
    assert fim("ab||cd", 1, 0, 0, split=True, fragment=0.75)[0] == ids("ab|cd_")
    assert fim("abcd", 0, split=True, fragment=0.75)[1] == [("binomial", 0.5)]


def test_no_prefix_leaves_the_document_after_its_draw():
    out, calls = fim("abcEEEExabc", 1, 1, [1, 3], 0, no_prefix="ab")
    # "abc" starts with "ab": left, after its FIM draw (no cut drawn); "xabc" cut at (1, 3): x | ab | c
    assert out == ids("abcEPxScMab")
    assert calls == [("binomial", 0.5), ("binomial", 0.5), ("randint", 0, 5), ("binomial", 0.25)]


RANDOM_SETTINGS = [
    dict(rate=0.5, spm_rate=0.5, fragment_rate=None, no_prefix=None, split=False),
    dict(rate=0.9, spm_rate=0.1, fragment_rate=0.6, no_prefix=None, split=True),
    dict(rate=1.0, spm_rate=1.0, fragment_rate=1.0, no_prefix="ab", split=True),
    dict(rate=0.3, spm_rate=0.0, fragment_rate=0.5, no_prefix="a", split=True),
]


def _random_samples(n: int, length: int, special: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        sample = rng.integers(0, 26, length)
        for token in special:
            sample[rng.random(length) < 0.08] = token
        samples.append(sample)
    return samples


@pytest.mark.parametrize("settings", RANDOM_SETTINGS)
def test_matches_megatrons_code_draw_for_draw(settings):
    """Megatron's GPTFIMDataset (one RandomState for the dataset) and our transform given one RandomState of the
    same seed: the same samples, in order, on 300 random samples with EODs and split tokens."""
    tokens = TOKENS if settings["split"] else dataclasses.replace(TOKENS, split=None)
    ours = FIMTransform(CHARS, tokens, settings["rate"], settings["spm_rate"], settings["fragment_rate"],
                        settings["no_prefix"])
    rng = np.random.RandomState(1234)
    samples = _random_samples(300, 33, [TOKENS.eod, TOKENS.split], seed=7)
    with megatron_fim_dataset_class() as cls:
        theirs = megatron_fim(cls, CHARS, tokens, settings["rate"], settings["spm_rate"], settings["fragment_rate"],
                              settings["no_prefix"], seed=1234)
        for sample in samples:
            expected = theirs(sample.copy())
            np.testing.assert_array_equal(ours(sample, rng), expected)
            assert expected.dtype == np.int64
    state, megatrons = rng.get_state(), theirs.dataset.np_rng.get_state()  # as many draws taken by both
    assert np.array_equal(state[1], megatrons[1]) and state[2] == megatrons[2]


@pytest.fixture(scope="module")
def gpt2_fim(corpus, tmp_path_factory) -> Tokenizer:
    flags = gpt2_with_fim_tokens(corpus, tmp_path_factory.mktemp("fim_tok"))
    return build_tokenizer("GPT2BPETokenizer", flags[3], flags[5])


def test_matches_megatrons_code_with_a_bpe_tokenizer(gpt2_fim, corpus):
    """The corpus's own samples through its byte-level BPE: cutting the text at characters and tokenizing the
    pieces again changes the token counts; samples are cut back, or padded (those that start with an EOD);
    '.' splits fragments."""
    from megatron.data.indexed_dataset import IndexedDataset

    data = IndexedDataset(str(corpus / "data" / "c_text_document"))
    stream = np.concatenate([data.get(i).astype(np.int64) for i in range(80)])
    starts = [*range(0, 64 * 50, 64), *np.flatnonzero(stream == gpt2_fim.eod)[:20]]  # some start with an EOD
    samples = [stream[i:i + 65] for i in starts]
    assert {len(sample) for sample in samples} == {65}
    d = parse_config(["--mock-data", "--fim-split-sample", ".", "--fim-fragment-rate", "0.5"]).dataset
    tokens = fim_tokens(d, gpt2_fim)
    assert (tokens.eod, tokens.split) == (gpt2_fim.eod, gpt2_fim.token_id("."))
    for split in (None, tokens.split):
        at = dataclasses.replace(tokens, split=split)
        ours, rng = FIMTransform(gpt2_fim, at, 0.7, 0.5, 0.5, None), np.random.RandomState(5)
        with megatron_fim_dataset_class() as cls:
            theirs = megatron_fim(cls, gpt2_fim, at, 0.7, 0.5, 0.5, None, seed=5)
            outs = [ours(s, rng) for s in samples]
            for sample, out in zip(samples, outs):
                np.testing.assert_array_equal(out, theirs(sample.copy()))
        assert any(at.pad in out for out in outs) and any(at.prefix in out for out in outs)


class Listed:
    """A split of fixed samples, as the builders' datasets look to the loader."""

    def __init__(self, samples):
        self.samples, self.eod_id, self.samples_per_epoch = samples, TOKENS.eod, len(samples)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def _fim_split(seed: int = 3, split: int = 0, n: int = 64) -> FIMDataset:
    transform = FIMTransform(CHARS, TOKENS, 0.5, 0.5, 0.5, None)
    return FIMDataset(Listed(_random_samples(n, 17, [TOKENS.eod, TOKENS.split], seed=11)), transform, seed, split)


def _batches(loader) -> list[np.ndarray]:
    return [batch["tokens"].numpy() for batch in loader]


def test_a_sample_is_the_same_whatever_reads_it_and_when():
    ds = _fim_split()
    forward = [ds[i] for i in range(len(ds))]
    backward = [ds[i] for i in reversed(range(len(ds)))][::-1]
    for a, b, c in zip(forward, backward, (_fim_split()[i] for i in range(len(ds)))):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert sum(not np.array_equal(ds[i], ds.dataset[i]) for i in range(len(ds))) > len(ds) // 3  # FIM happens
    assert any(not np.array_equal(_fim_split(seed=4)[i], forward[i]) for i in range(len(ds)))  # the seed counts
    assert any(not np.array_equal(_fim_split(split=1)[i], forward[i]) for i in range(len(ds)))  # so does the split
    # data-parallel ranks, DataLoader workers and a resume read the same samples
    whole = _batches(build_loader(ds, 0, 8, TOKENS.eod, True))
    workers = _batches(build_loader(_fim_split(), 0, 8, TOKENS.eod, True, num_workers=2))
    ranks = [_batches(build_loader(_fim_split(), 0, 8, TOKENS.eod, True, dp_rank=r, dp_size=2)) for r in (0, 1)]
    resumed = _batches(build_loader(_fim_split(), 24, 8, TOKENS.eod, True))
    assert len(whole) == 8
    for step, batch in enumerate(whole):
        np.testing.assert_array_equal(batch, workers[step])
        np.testing.assert_array_equal(batch, np.concatenate([ranks[0][step], ranks[1][step]]))
        if step >= 3:
            np.testing.assert_array_equal(batch, resumed[step - 3])


def test_rates_are_the_probabilities_they_say():
    """Over 4000 one-document samples of 10 characters: FIM in about fim_rate of them; <prefix> <suffix> first in
    SPM's share of those, plus PSM's with an empty prefix (the first cut at 0: 1 - (10/11)^2)."""
    transform = FIMTransform(CHARS, dataclasses.replace(TOKENS, split=None), 0.3, 0.8)
    sample = np.array(ids("abcdefghij"))
    outs = [transform(sample, sample_rng(9, 0, i)) for i in range(4000)]
    fimmed = [out for out in outs if out[0] == TOKENS.prefix]
    suffix_second = [out for out in fimmed if out[1] == TOKENS.suffix]
    assert abs(len(fimmed) / 4000 - 0.3) < 4 * (0.3 * 0.7 / 4000) ** 0.5
    expected = 0.8 + 0.2 * (1 - (10 / 11) ** 2)
    assert abs(len(suffix_second) / len(fimmed) - expected) < 4 * (expected * (1 - expected) / len(fimmed)) ** 0.5


def test_with_fim_wraps_every_split_and_keeps_what_the_loader_reads(gpt2_fim):
    config = parse_config(["--mock-data", "--fim-data", "--seed", "5"])
    train, valid = Listed([np.arange(9)]), Listed([np.arange(9)])
    wrapped = with_fim((train, valid, None), config, gpt2_fim)
    assert wrapped[2] is None and [w.split for w in wrapped[:2]] == [0, 1] and wrapped[0].seed == 5
    assert wrapped[0].dataset is train and wrapped[0].eod_id == train.eod_id and wrapped[0].samples_per_epoch == 1


def _validated(*flags: str):
    config = parse_config(["--input-dir", "d", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v",
                           "--merge-file", "m", "--fim-data", *flags])
    validate(config, tokenizer_vocab_size=404)
    return config


@pytest.mark.parametrize("flags, message", [
    (["--fim-rate", "1.5"], "fim_rate (--fim-rate) is a probability, so it must be in [0, 1], got 1.5"),
    (["--fim-spm-rate", "-0.5"], "fim_spm_rate (--fim-spm-rate) is a probability, so it must be in [0, 1], got -0.5"),
    (["--fim-split-sample", "|", "--fim-fragment-rate", "-0.1"],
     "fim_fragment_rate (--fim-fragment-rate) is a probability"),
    (["--fim-split-sample", "|"], "--fim-split-sample | cuts documents into fragments, each rearranged with "
                                  "probability --fim-fragment-rate, which is not set; give --fim-fragment-rate"),
    (["--fim-suffix-token", "<fim_prefix>"], "--fim-suffix-token and --fim-prefix-token are both '<fim_prefix>'"),
    (["--fim-split-sample", "<|endoftext|>", "--fim-fragment-rate", "1"],
     "--fim-split-sample and --fim-eod-token are both '<|endoftext|>'"),
])
def test_bad_settings_are_one_sentence_errors(flags, message):
    with pytest.raises(ConfigError) as err:
        _validated(*flags)
    assert message in str(err.value) and str(err.value).endswith(".")


def test_fim_needs_real_data_and_a_tokenizer_with_token_strings():
    with pytest.raises(ConfigError, match="--fim-data rearranges the documents of real data, but mock_data is set"):
        validate(parse_config(["--mock-data", "--fim-data"]))
    with pytest.raises(ConfigError, match="NullTokenizer .ids written as numbers. has none"):
        validate(parse_config(["--input-dir", "d", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                               "--fim-data"]), tokenizer_vocab_size=100)
    with pytest.raises(ConfigError, match="fim_rate .--fim-rate. is a probability"):  # checked without --fim-data
        validate(parse_config(["--mock-data", "--fim-rate", "7"]))
    validate(parse_config(["--mock-data", "--fim-split-sample", "|"]))  # the rest is not read without --fim-data
    config = _validated("--fim-rate", "0", "--fim-spm-rate", "1")  # 0 and 1 are probabilities
    assert (config.dataset.fim_rate, config.dataset.fim_spm_rate) == (0.0, 1.0)


def test_megatrons_defaults():
    d = parse_config(["--mock-data"]).dataset
    assert (d.fim_data, d.fim_rate, d.fim_spm_rate, d.fim_split_sample, d.fim_fragment_rate, d.fim_no_prefix) == (
        False, 0.5, 0.5, None, None, None)
    assert (d.fim_prefix_token, d.fim_middle_token, d.fim_suffix_token, d.fim_pad_token, d.fim_eod_token) == (
        *FIM_TOKENS, "<|endoftext|>")


def test_the_tokens_are_looked_up_in_the_vocabulary(gpt2_fim, corpus):
    d = parse_config(["--mock-data"]).dataset
    tokens = fim_tokens(d, gpt2_fim)
    assert [tokens.prefix, tokens.middle, tokens.suffix, tokens.pad] == [gpt2_fim.vocab_size - 4 + i for i in range(4)]
    assert tokens.eod == gpt2_fim.eod and tokens.split is None
    plain = build_tokenizer("GPT2BPETokenizer", corpus / "tok" / "vocab.json", corpus / "tok" / "merges.txt")
    with pytest.raises(ConfigError) as err:
        fim_tokens(d, plain)
    assert str(err.value) == (
        "--fim-prefix-token '<fim_prefix>' is not a token of the tokenizer's vocabulary (--tokenizer-type "
        "GPT2BPETokenizer), and --fim-data needs each FIM token as one vocabulary entry; give --fim-prefix-token a "
        "token the tokenizer has, or use a tokenizer with FIM tokens (StarCoder's <fim_prefix>, <fim_middle>, "
        "<fim_suffix>, <fim_pad>).")
    d.fim_split_sample = "the cat"  # text of several tokens is not a token
    with pytest.raises(ConfigError, match="--fim-split-sample 'the cat' is not a token"):
        fim_tokens(d, gpt2_fim)
