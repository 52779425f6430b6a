"""tools/evaluate.py's ``--task lm-eval``: lm-eval's tasks found before any checkpoint is read, then lm-eval's
evaluator run on a ``MegatronLM``.

lm-eval is optional (``pip install -e .[eval]``): this module imports it only when called, and says so in one
line when it is missing.
"""

from __future__ import annotations

import json
import logging


class HarnessError(ValueError):
    """A problem with the lm-eval request (lm-eval missing, an unknown task): one line for the user."""


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        raise HarnessError(f"--task lm-eval needs lm-evaluation-harness ({err}): pip install -e .[eval] "
                           f"(or pip install lm-eval).") from err


def task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's TaskManager that knows ``tasks``: the tasks under ``include_path`` alone when they are all there
    (indexing lm-eval's own thousands of tasks takes many seconds), else lm-eval's with them. HarnessError
    naming the tasks neither knows."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    if not tasks:
        raise HarnessError("--lm-eval-tasks is empty: name at least one lm-eval task (T1,T2,...).")
    if include_path is not None:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if not _missing(manager, tasks):
            return manager
    manager = TaskManager(include_path=include_path)
    missing = _missing(manager, tasks)
    if missing:
        where = f" nor under --include-path {include_path}" if include_path else ""
        raise HarnessError(f"unknown lm-eval task{'s' if len(missing) > 1 else ''} {', '.join(missing)}: not one of "
                           f"lm-eval's{where} ('lm-eval ls tasks' lists lm-eval's; give --include-path DIR for "
                           f"your own YAML tasks).")
    return manager


def _missing(manager, tasks: list[str]) -> list[str]:
    return [t for t in tasks if not manager.match_tasks([t])]


def evaluate(lm, tasks: list[str], manager, limit: float | None = None, num_fewshot: int | None = None,
             log_samples: bool = False, bootstrap_iters: int = 100000) -> dict | None:
    """lm-eval's results dictionary (``results`` keyed by task, metrics as lm-eval names them), made JSON-safe
    (lm-eval's own ``handle_non_serializable``); ``samples`` (each example's requests and responses) only
    with ``log_samples``; None where lm-eval returns none (LOCAL_RANK > 0). ``bootstrap_iters``: lm-eval's,
    for the metrics' standard errors (0: none)."""
    import lm_eval
    from lm_eval.utils import handle_non_serializable

    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, log_samples=log_samples,
                                      bootstrap_iters=bootstrap_iters)
    if results is None:  # a process of local rank > 0: lm-eval's evaluator returns nothing there
        return None
    return json.loads(json.dumps(results, default=handle_non_serializable))
