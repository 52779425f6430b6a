"""Offline lm-eval tasks over local JSON lines, written by the tests themselves (lm-eval reads them with
``dataset_path: json``; nothing is downloaded, and the datasets cache is the folder's ``cache``): give
``--include-path`` (or ``TaskManager(include_path=...)``) the folder ``write_tasks`` returns.

- ``megatron_cloze`` (``loglikelihood``; ``acc``, ``perplexity``): lm-eval's ``lambada_openai`` definition, a
  passage's last word predicted from the rest (the target with its leading space).
- ``megatron_rolling`` (``loglikelihood_rolling``; ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``):
  lm-eval's ``wikitext`` definition, whole documents scored in rolling windows.
- ``megatron_generate`` (``generate_until``; ``exact_match``): greedy generation from a prompt until a newline
  or ``max_gen_toks`` tokens, compared with the answer.
"""

from __future__ import annotations

import json
from pathlib import Path

CLOZE, ROLLING, GENERATE = "megatron_cloze", "megatron_rolling", "megatron_generate"
TASKS = (CLOZE, ROLLING, GENERATE)
MAX_GEN_TOKS = 6

_YAML = {
    CLOZE: """output_type: loglikelihood
test_split: train
doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}"
doc_to_target: "{{' '+text.split(' ')[-1]}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    ROLLING: """output_type: loglikelihood_rolling
test_split: train
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
""",
    GENERATE: f"""output_type: generate_until
test_split: train
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


def write_tasks(folder: Path, cloze: list[str], documents: list[str], generate: list[tuple[str, str]]) -> Path:
    """The three tasks in ``folder`` (created): ``cloze`` passages (their last word the target), ``documents``
    (scored whole) and ``generate`` (prompt, answer) pairs; the folder, for ``--include-path``."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = {CLOZE: [{"text": t} for t in cloze], ROLLING: [{"text": t} for t in documents],
            GENERATE: [{"prompt": p, "answer": a} for p, a in generate]}
    for name in TASKS:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        (folder / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\n"
                                             f"dataset_kwargs:\n  data_files:\n    train: {json.dumps(str(data))}\n"
                                             f"  cache_dir: {json.dumps(str(folder / 'cache'))}\n"
                                             + _YAML[name])
    return folder


def hf_lm(path: str, max_length: int, batch_size: int):
    """lm-eval's ``hf`` backend (``HFLM``) on the Hugging Face export at ``path``, on this one CPU process (it
    imports ``accelerate``: the test extra installs it, as lm-eval's ``hf`` extra would)."""
    import transformers
    from lm_eval.models.huggingface import HFLM

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()  # given loaded: no device map
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", max_length=max_length, batch_size=batch_size)
