"""Debug switches read from the environment (tinygrad-style levels).

``LAZYGGML_DEBUG=1`` logs the allocator's memory report and the OpenCL compiler's build log and
warnings (hidden otherwise); ``LAZYGGML_SCHED_DEBUG=1|2`` logs the
scheduler's splits (and every node at 2). Both go through the ``logging`` logger ``"lazyggml"``.
"""
import logging
import os
import re

log = logging.getLogger("lazyggml")


def level(name):
    """The value of environment variable ``name`` read as C's ``atoi`` (GGML reads its switches so)."""
    m = re.match(r"\s*([+-]?\d+)", os.environ.get(name) or "")
    return int(m.group(1)) if m else 0


def enable_log():
    """Make DEBUG records visible: GGML prints them to stderr unconditionally. A handler is added
    only when the application configured none, so nothing is printed twice."""
    if log.level == logging.NOTSET or log.level > logging.DEBUG:
        log.setLevel(logging.DEBUG)
    if not log.hasHandlers():
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
