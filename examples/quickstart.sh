#!/usr/bin/env bash
# Quickstart: from text already on this machine to a trained GPT, on the CPU, in a few minutes.
#   1. a corpus of the Python standard library's docstrings and help topics (tools/make_stdlib_corpus.py)
#   2. a 4,096-token byte-level BPE tokenizer trained on it (tools/train_tokenizer.py)
#   3. the corpus tokenized into a .bin/.idx pair (tools/preprocess_data.py)
#   4. a 4-layer GPT trained on it (pretrain_gpt.py), evaluated on held-out modules
# Extra arguments go to pretrain_gpt.py (for example --max-steps 100 or --no-bf16).
set -euo pipefail
cd "$(dirname "$0")/.."
work=${WORK:-./output/quickstart}
mkdir -p "$work"
python tools/make_stdlib_corpus.py --output "$work/corpus.jsonl"
python tools/train_tokenizer.py --input "$work/corpus.jsonl" --type bpe --vocab-size 4096 --output-dir "$work/tokenizer"
python tools/preprocess_data.py --input "$work/corpus.jsonl" --output-prefix "$work/data/stdlib" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$work/tokenizer/vocab.json" \
    --merge-file "$work/tokenizer/merges.txt" --append-eod --workers 2 --log-interval 1000
rm -f "$work/train/metrics.jsonl"
python pretrain_gpt.py -c examples/configs/gpt_quickstart.yaml --input-dir "$work/data/stdlib_text_document" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$work/tokenizer/vocab.json" \
    --merge-file "$work/tokenizer/merges.txt" --save "$work/train" "$@"
python - "$work/train/metrics.jsonl" <<'PY'
import json, math, sys
records = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in records if r["split"] == "train"]
valid = [r for r in records if r["split"] == "valid"]
start = math.log(4096)
print(f"\nquickstart: untrained loss ln(4096) = {start:.2f}; train loss {train[0]['loss']:.2f} at step "
      f"{train[0]['step']} -> {train[-1]['loss']:.2f} at step {train[-1]['step']}")
print("quickstart: validation loss (held-out modules): " +
      ", ".join(f"{r['loss']:.2f} at step {r['step']}" for r in valid))
if not valid[-1]["loss"] < start - 2.0:
    sys.exit("quickstart: the validation loss did not fall as expected")
print("quickstart: the model learned.")
PY
