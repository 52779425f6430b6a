"""The generation engine against a full recompute of every sequence and against transformers on the
exported weights, plus sampling, stopping and streaming (fp32, one process)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import megatron.inference.engine as engine_module
from megatron.inference import (
    InferenceEngine,
    PromptError,
    Request,
    SamplingParams,
    load_model,
    tokenizer_for,
)
from tests.functional.launch import run_tool_here
from tests.inference.conftest import PROMPTS


def _requests(engine, **params) -> list[Request]:
    return [Request(engine.tokenizer.tokenize(p), SamplingParams(**params)) for p in PROMPTS]


@pytest.mark.parametrize("model", ["engine", "mla_engine"])
def test_kv_cache_decoding_equals_a_full_recompute_at_every_step(model, request, monkeypatch):
    """Every step's logits (left-padded batch, rows finishing at different lengths and dropped from the
    cache) equal the model run on that row's whole sequence alone; for GPT-2's attention and for multi-latent
    attention (whose cache holds keys of qk_head_dim + qk_pos_emb_head_dim channels and narrower values)."""
    engine = request.getfixturevalue(model)
    seen = []
    real_choose = engine_module.choose

    def recording_choose(logits, rows, shard):
        seen.append((logits.clone(), [r.prompt + r.output for r in rows]))
        return real_choose(logits, rows, shard)

    monkeypatch.setattr(engine_module, "choose", recording_choose)
    requests = [Request(engine.tokenizer.tokenize(p), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                for p, n in zip(PROMPTS, (12, 3, 20, 7), strict=True)]
    engine.generate(requests)
    assert len(seen) == 20 and [len(rows) for _, rows in seen][:4] == [4, 4, 4, 3]
    vocab = engine.config.model.vocab_size
    with torch.no_grad():
        for logits, sequences in seen:
            for row, sequence in enumerate(sequences):
                full = engine.model(torch.tensor([sequence]))[0, -1, :vocab]
                torch.testing.assert_close(logits[row, :vocab], full, rtol=0, atol=1e-5)


def _hf_model(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    result = run_tool_here("tools/convert_checkpoint.py", "to-hf", checkpoint, str(out))  # in this process
    assert result.returncode == 0, result.stderr
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as ignore_eos does
    hf.generation_config.pad_token_id = 0
    return hf


def test_greedy_tokens_and_logprobs_equal_transformers_on_the_exported_weights(engine, checkpoint, tmp_path):
    hf = _hf_model(checkpoint, tmp_path)
    requests = _requests(engine, max_tokens=32, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=True)
    completions = engine.generate(requests)
    with torch.no_grad():
        for request, completion in zip(requests, completions, strict=True):
            prompt = torch.tensor([request.prompt])
            expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   max_new_tokens=32)[0, len(request.prompt):].tolist()
            assert completion.tokens == expected
            assert completion.finish_reason == "length"
            sequence = torch.tensor([request.prompt + completion.tokens])
            logprobs = torch.log_softmax(hf(sequence).logits[0, :-1].double(), dim=-1)
            picked = logprobs.gather(1, sequence[0, 1:].unsqueeze(1)).squeeze(1)
            n = len(request.prompt)
            torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.double), picked[n - 1:],
                                       rtol=0, atol=1e-4)
            assert completion.prompt_logprobs[0] is None
            torch.testing.assert_close(torch.tensor(completion.prompt_logprobs[1:], dtype=torch.double),
                                       picked[:n - 1], rtol=0, atol=1e-4)


def test_top_logprobs_are_the_most_likely_tokens(engine):
    prompt = engine.tokenizer.tokenize(PROMPTS[2])
    (completion,) = engine.generate([Request(prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=3,
                                                                    prompt_logprobs=True))])
    for chosen, top in zip(completion.logprobs, completion.top_logprobs, strict=True):
        assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][1] == pytest.approx(chosen, abs=1e-6)  # greedy picks the most likely token
    assert completion.prompt_top_logprobs[0] is None and len(completion.prompt_top_logprobs) == len(prompt)
    for token, actual, top in zip(prompt[1:], completion.prompt_logprobs[1:], completion.prompt_top_logprobs[1:],
                                  strict=True):
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert actual <= top[0][1] + 1e-6
        assert dict(top).get(token, actual) == pytest.approx(actual, abs=1e-6)


def test_a_seeded_sample_is_reproducible_and_the_seed_matters(engine):
    def sample(seed, **extra):
        params = dict(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True, **extra)
        return [c.tokens for c in engine.generate(_requests(engine, **params))]

    for extra in ({}, {"top_k": 20}, {"top_p": 0.8}):
        assert sample(7, **extra) == sample(7, **extra)
        assert sample(7, **extra) != sample(8, **extra)
    greedy = [c.tokens for c in engine.generate(_requests(engine, max_tokens=24, temperature=0, ignore_eos=True))]
    assert sample(7, top_k=1) == greedy


def test_penalties_change_the_choice_of_repeated_tokens(engine):
    plain = engine.generate(_requests(engine, max_tokens=24, temperature=0, ignore_eos=True))
    penalised = engine.generate(_requests(engine, max_tokens=24, temperature=0, ignore_eos=True,
                                          frequency_penalty=2.0))
    for a, b in zip(plain, penalised, strict=True):
        assert max(b.tokens.count(t) for t in b.tokens) <= max(a.tokens.count(t) for t in a.tokens)
    assert any(a.tokens != b.tokens for a, b in zip(plain, penalised, strict=True))


def test_generation_stops_on_stop_strings_and_at_max_tokens(engine):
    (greedy,) = engine.generate([Request(engine.tokenizer.tokenize(PROMPTS[0]),
                                         SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))])
    assert greedy.finish_reason == "length" and len(greedy.tokens) == 24
    text = greedy.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    (stopped,) = engine.generate([Request(engine.tokenizer.tokenize(PROMPTS[0]),
                                          SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                         stop=["never in the text", stop]))])
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:text.index(stop)]
    assert stopped.tokens == greedy.tokens[:len(stopped.tokens)] and len(stopped.tokens) < 24


@contextmanager
def _eod_always_next(engine):
    """Make the end-of-document token the model's argmax everywhere: the final LayerNorm outputs a
    constant vector and EOD's (tied) head row points along it."""
    norm, head = engine.model.final_layernorm, engine.model.embedding.word_embeddings.weight
    saved = norm.weight.clone(), norm.bias.clone(), head[engine.eod].clone()
    with torch.no_grad():
        norm.weight.zero_()
        norm.bias.fill_(1.0)
        head[engine.eod] = 10.0
    try:
        yield
    finally:
        with torch.no_grad():
            norm.weight.copy_(saved[0])
            norm.bias.copy_(saved[1])
            head[engine.eod] = saved[2]


def test_generation_stops_on_the_end_of_document_token_unless_told_to_ignore_it(engine):
    prompt = engine.tokenizer.tokenize("the model")
    with _eod_always_next(engine):
        ended, ignored = engine.generate([Request(prompt, SamplingParams(max_tokens=5, temperature=0)),
                                          Request(prompt, SamplingParams(max_tokens=5, temperature=0,
                                                                         ignore_eos=True))])
    assert (ended.finish_reason, ended.tokens, ended.text) == ("stop", [], "")
    assert ignored.finish_reason == "length" and ignored.tokens == [engine.eod] * 5


def test_streamed_text_is_the_completion_text_and_arrives_token_by_token(engine):
    requests = _requests(engine, max_tokens=10, temperature=0, ignore_eos=True)
    steps = list(engine.stream(requests))
    assert len(steps) == 11  # the prefill, then one step per token
    texts = [""] * len(requests)
    for events in steps:
        for e in events:
            texts[e.index] += e.text
    assert texts == [c.text for c in engine.generate(requests)]


def test_scoring_only_and_cancelled_rows(engine):
    prompt = engine.tokenizer.tokenize(PROMPTS[2])
    (scored,) = engine.generate([Request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=True))])
    assert scored.tokens == [] and scored.finish_reason == "length"
    assert len(scored.prompt_logprobs) == len(prompt) and all(lp < 0 for lp in scored.prompt_logprobs[1:])

    requests = _requests(engine, max_tokens=30, temperature=0, ignore_eos=True)
    finished, steps = {}, [0]
    for events in engine.stream(requests, cancelled=lambda index: index == 1 and steps[0] >= 2):
        finished.update({e.index: (steps[0], e.finish_reason) for e in events if e.finish_reason})
        steps[0] += 1
    assert finished[1] == (2, "cancelled")  # dropped in the first step whose check says so
    assert all(finished[i] == (30, "length") for i in (0, 2, 3))


@pytest.mark.parametrize("params, field", [
    ({"max_tokens": -1}, "max_tokens"), ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": 2.5}, "top_k"), ({"logprobs": 99}, "logprobs"), ({"stop": [""]}, "stop"),
    ({"max_tokens": 95}, "max_tokens"),
])
def test_bad_requests_are_refused_naming_the_field(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.generate([Request(engine.tokenizer.tokenize("the model reads"), SamplingParams(**params))])


@pytest.mark.parametrize("params, field", [
    ({"seed": 2**64}, "seed"), ({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -1e30}, "frequency_penalty"),
    ({"temperature": float("inf")}, "temperature"), ({"top_k": -1}, "top_k"),
])
def test_out_of_range_fields_are_refused_before_any_work(engine, params, field):
    """A seed torch or the seed broadcast cannot take (today: an overflow inside the batch), a penalty
    beyond OpenAI's [-2, 2]: refused by ``check``, which every caller runs before a batch."""
    with pytest.raises(ValueError, match=f"^{field} must be"):
        engine.check(Request([1, 2], SamplingParams(**params)))
    engine.check(Request([1, 2], SamplingParams(seed=2**63 - 1)))  # the ends of the range are seeds
    engine.check(Request([1, 2], SamplingParams(seed=-2**63)))


EXTREMES = [{"temperature": 1e-300}, {"temperature": 1e-300, "top_k": 10**9}, {"top_p": 1e-12},
            {"top_k": 1, "temperature": 1e300}, {"temperature": 0.5, "top_k": 10**6, "top_p": 1e-300}]
WILD = [{"temperature": 1e300}, {"temperature": 1e300, "top_k": 10**9},
        {"repetition_penalty": 1e-300, "temperature": 2.0},
        {"repetition_penalty": 1e300, "presence_penalty": -2, "frequency_penalty": -2}]


def test_extreme_sampling_settings_give_real_tokens(engine):
    """One batch, a row per setting. A temperature that underflows (today: NaN probabilities, and with
    top_k beyond the padded vocabulary a padding id) or a top_p that keeps one candidate chooses what
    greedy chooses; a huge temperature or penalty samples real ids, nearly uniformly."""
    ids = engine.tokenizer.tokenize(PROMPTS[0])
    greedy = engine.generate([Request(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))])[0]
    out = engine.generate([Request(ids, SamplingParams(max_tokens=8, seed=5, ignore_eos=True, **params))
                           for params in EXTREMES + WILD])
    assert [c.tokens for c in out[:len(EXTREMES)]] == [greedy.tokens] * len(EXTREMES)
    wild = [t for c in out[len(EXTREMES):] for t in c.tokens]
    assert len(wild) == 32 and all(0 <= t < engine.config.model.vocab_size for t in wild)
    assert len(set(wild)) > 8  # not one stuck id


def test_padding_ids_are_never_candidates():
    """Logits of the padded vocabulary's extra rows (any value) are never sampled, even with top_k
    beyond the padded size, a temperature that underflows, or every real logit -inf."""
    from megatron.inference.sampling import RowState, VocabShard, choose

    shard = VocabShard(0, 384, 300)
    logits = torch.randn(3, 384)
    logits[:, 300:] = 1e4
    logits[2, :300] = -float("inf")
    for params in ({"temperature": 1e-300, "top_k": 10**9}, {"temperature": 1e300, "top_k": 1000}, {"top_p": 1e-9}):
        rows = [RowState(SamplingParams(**params), [1], torch.Generator().manual_seed(s)) for s in range(3)]
        tokens = choose(logits, rows, shard).tokens
        assert all(t < 300 for t in tokens), (params, tokens)
        if params.get("temperature", 1) < 1:
            assert tokens[:2] == logits[:2, :300].argmax(-1).tolist()


def test_empty_and_out_of_vocabulary_prompts_are_refused(engine):
    with pytest.raises(PromptError, match="empty"):
        engine.generate([Request([], SamplingParams())])
    with pytest.raises(PromptError, match="outside the vocabulary"):
        engine.generate([Request([engine.config.model.vocab_size], SamplingParams())])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_models_generate_from_the_same_checkpoint(checkpoint, dtype):
    model, config = load_model(checkpoint, dtype)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16 if dtype == "bf16" else torch.float16}
    half = InferenceEngine(model, config, tokenizer_for(config))
    completions = half.generate([Request(half.tokenizer.tokenize(p), SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)) for p in PROMPTS])
    assert all(len(c.tokens) == 8 and all(lp <= 0 for lp in c.logprobs) for c in completions)


@pytest.mark.parametrize("detokenize, prompt, new, want", [
    (lambda ids: " ".join(map(str, ids)), [5, 6, 7], [48, 32], " 48 32"),  # NullTokenizer: ids joined by spaces
    (lambda ids: "".join({1: "\u2581the", 2: "\u2581cat"}[i] for i in ids).replace("\u2581", " ").lstrip(),
     [1], [2], " cat"),  # SentencePiece: a decoded text loses its leading space
    (lambda ids: "".join({1: "a", 2: "b"}[i] for i in ids), [], [1, 2], "ab"),  # no prompt
])
def test_completion_text_continues_the_prompt(detokenize, prompt, new, want):
    from megatron.inference.text import TextTracker

    tracker = TextTracker(detokenize, [], prompt)
    assert "".join(tracker.add(t) for t in new) + tracker.finish() == want
