"""Evaluating a checkpoint with the training forward, on lm-eval's definitions: the tasks' samples
(``tasks``: lm-eval's rolling windows, Megatron-LM's strided windows, LAMBADA items in both modes), the
figures of each task (``perplexity``, ``lambada``) and the runner that scores samples under any layout
(``runner``). The command-line tool is ``tools/evaluate.py``."""
