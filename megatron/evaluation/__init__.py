"""Evaluating a checkpoint with the training forward: the tasks' samples (``tasks``: perplexity with
overlapping windows, LAMBADA strict and non-strict) and the runner that scores them under any layout
(``runner``). The command-line tool is ``tools/evaluate.py``."""
