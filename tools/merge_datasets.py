"""Concatenate several indexed datasets (.bin/.idx pairs of one dtype) into one.

    python tools/merge_datasets.py --input data/part1_text_document data/part2_text_document \\
        --output-prefix data/all_text_document

``--input`` takes prefixes or folders (every pair in a folder, in name order). The .bin files
are copied in chunks, so memory stays flat; the output appears only when complete.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.blended_dataset import parse_input_dir  # noqa: E402
from megatron.data.indexed_dataset import DatasetError, IndexedDataset, IndexedDatasetWriter  # noqa: E402


def merge(prefixes: list[str], output_prefix: str) -> int:
    """Merge ``prefixes`` in order into ``output_prefix``; returns the document count."""
    if os.path.abspath(output_prefix) in {os.path.abspath(p) for p in prefixes}:
        raise DatasetError(f"--output-prefix {output_prefix} is also an input; choose another name.")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for prefix in prefixes:
            writer.add_index(prefix)
        count = writer.num_documents
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="merge_datasets.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="Dataset prefixes or folders of them.")
    parser.add_argument("--output-prefix", required=True, help="Prefix of the merged .bin/.idx.")
    args = parser.parse_args(argv)
    try:
        prefixes = [p for item in args.input for p in parse_input_dir(item)[0]]
        count = merge(prefixes, args.output_prefix)
    except DatasetError as err:
        print(f"merge_datasets.py: error: {err}", file=sys.stderr)
        return 2
    print(f"merged {len(prefixes)} datasets, {count} documents, into {args.output_prefix}.bin/.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
