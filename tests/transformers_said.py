"""What transformers said while a block ran: its warnings and its logger's records (which do not propagate to the
root logger, so pytest's capture misses them)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def transformers_said() -> Iterator[list[str]]:
    """The messages, filled in when the block ends."""
    said: list[str] = []
    logged: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield said
    finally:
        library.removeHandler(handler)
        said.extend([str(w.message) for w in caught] + [r.getMessage() for r in logged])
