"""tools/evaluate.py's ``--task lm-eval``: lm-eval's tasks found before any checkpoint is read, then lm-eval's
evaluator run on a ``MegatronLM``.

lm-eval is optional (``pip install -e .[eval]``): this module imports it only when called, and says so in one
line when it is missing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path


class HarnessError(ValueError):
    """A problem with the lm-eval request (lm-eval missing, an unknown task): one line for the user."""


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        raise HarnessError(f"--task lm-eval needs lm-evaluation-harness ({err}): pip install -e .[eval] "
                           f"(or pip install lm-eval).") from err


# Folders lm-eval's task index does not look in (lm_eval.tasks._yaml_loader's _IGNORE_DIRS).
_IGNORED_FOLDERS = {"__pycache__", ".ipynb_checkpoints"}


def read_include_path(include_path: str) -> list[str]:
    """Read every task YAML under ``include_path`` as lm-eval's task index will (``**/*.yaml``); return what in
    the folder is Python that lm-eval may run: the YAML files using ``!function`` (lm-eval imports the named
    module, a ``.py`` beside the YAML, when it builds the task) and the folder's ``.py`` files. HarnessError,
    one line naming the file and YAML's line and column, for a file YAML cannot read: lm-eval's index skips it
    without a word, and the task it held would be reported unknown."""
    root = Path(include_path)
    yamls = sorted(p for p in root.glob("**/*.yaml") if not _IGNORED_FOLDERS & set(p.parts))
    code = [f"!function in {p.relative_to(root)}" for p in yamls if _uses_function(p)]
    code += sorted(str(p.relative_to(root)) for p in root.glob("**/*.py") if not _IGNORED_FOLDERS & set(p.parts))
    return code


def _uses_function(path: Path) -> bool:
    """Whether the task YAML ``path`` uses ``!function``; HarnessError for one YAML cannot read."""
    import yaml

    used: list[str] = []

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # lm-eval's loader, the functions not imported
        pass

    Loader.add_constructor("!function", lambda loader, node: used.append(loader.construct_scalar(node)) or "")
    try:
        with path.open("rb") as f:
            yaml.load(f, Loader=Loader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as err:
        raise HarnessError(f"{path} is not valid YAML ({_yaml_problem(err)}): fix it, or move it out of the "
                           f"--include-path folder.") from None
    except OSError as err:
        raise HarnessError(f"cannot read {path} ({err.strerror or err}): fix it, or move it out of the "
                           f"--include-path folder.") from None
    return bool(used)


def _yaml_problem(err) -> str:
    """YAML's error on one line: ``line L, column C: problem``, and what it was reading from where."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    problem, context = getattr(err, "problem", None), getattr(err, "context", None)
    if not problem:
        return " ".join(str(err).split())
    text = f"{at(err.problem_mark)}: {problem}" if getattr(err, "problem_mark", None) else str(problem)
    if context:
        mark = getattr(err, "context_mark", None)
        text += f", {context}" + (f" from {at(mark)}" if mark is not None else "")
    return text


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


def table(result: dict) -> str:
    """lm-eval's own results table (``lm_eval.utils.make_table``, Markdown), and its groups' table when the
    tasks include groups, as the ``lm-eval`` command prints them."""
    from lm_eval.utils import make_table

    text = make_table(result)
    if result.get("groups"):
        text += "\n" + make_table(result, "groups")
    return text
