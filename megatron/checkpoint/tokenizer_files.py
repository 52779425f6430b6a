"""Finding the tokenizer files a checkpoint's configuration names, wherever the run was launched from.

A run saves the tokenizer's paths as given (often relative to the folder it was launched from).
``locate`` finds such a path from elsewhere; ``find_tokenizer_files`` applies it to a configuration read
from a checkpoint, so that generation, evaluation, export and resuming work from any folder.
"""

from __future__ import annotations

import os

TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model")


def locate(path: str, step_dir: str) -> str | None:
    """The file or folder a checkpoint's config names as ``path``: as given (relative to the current
    folder), else relative to each folder above the step folder (the run may have been launched from
    any of them), else by its name in the step folder, the run folder or the run folder's
    ``tokenizer/`` (files kept with the checkpoint, e.g. by ``from-hf``); None when none exists."""
    step_dir = os.path.abspath(step_dir)
    run_dir = os.path.dirname(step_dir)
    candidates = [path]
    if not os.path.isabs(path):
        folder = step_dir
        while True:
            candidates.append(os.path.join(folder, path))
            if os.path.dirname(folder) == folder:
                break
            folder = os.path.dirname(folder)
    name = os.path.basename(os.path.normpath(path))
    candidates += [os.path.join(d, name) for d in (step_dir, run_dir, os.path.join(run_dir, "tokenizer"))]
    return next((os.path.abspath(c) for c in candidates if os.path.exists(c)), None)


def find_tokenizer_files(section, step_dir: str) -> None:
    """Point each file of the ``tokenizer:`` ``section`` that does not exist as given at where ``locate``
    finds it (in place); a file found nowhere is left as it is, for the tokenizer to report."""
    for name in TOKENIZER_FILES:
        value = getattr(section, name)
        if value and not os.path.exists(value):
            found = locate(str(value), step_dir)
            if found is not None:
                setattr(section, name, found)
