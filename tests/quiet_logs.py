"""Quiet logs for a test, as they were afterwards: a logger level left at ERROR hides the warnings other files'
tests read from ``caplog``, in whichever process (pytest-xdist worker) ran the quieting file first."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_logs(*names: str) -> Iterator[None]:
    """The named loggers at ERROR, transformers' verbosity at error and warnings ignored; all restored."""
    import transformers

    loggers = [logging.getLogger(name) for name in names]
    levels, verbosity = [x.level for x in loggers], transformers.logging.get_verbosity()
    for x in loggers:
        x.setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for x, level in zip(loggers, levels):
            x.setLevel(level)
        transformers.logging.set_verbosity(verbosity)
