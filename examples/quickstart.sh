#!/usr/bin/env bash
# Quickstart: train a tiny GPT on the CPU and show that it learned.
# The data is the built-in synthetic corpus (a fixed random bigram language over 1,024 tokens):
# an untrained model is at ln(1024) = 6.93 nats; the language itself has ~1.2 nats of entropy.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-./output/quickstart}
rm -rf "$out"
python pretrain_gpt.py -c examples/configs/gpt_tiny_cpu.yaml --save "$out" "$@"
python - "$out/metrics.jsonl" <<'PY'
import json, math, sys
records = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in records if r["split"] == "train"]
valid = [r for r in records if r["split"] == "valid"]
first, last = train[0]["loss"], train[-1]["loss"]
print(f"\nquickstart: train loss {first:.3f} at step {train[0]['step']} -> {last:.3f} at step {train[-1]['step']}; "
      f"validation loss {valid[-1]['loss']:.3f} (untrained: ln(1024) = {math.log(1024):.3f})")
if not valid[-1]["loss"] < 0.6 * math.log(1024):
    sys.exit("quickstart: the validation loss did not fall as expected")
print("quickstart: the model learned.")
PY
