"""The ``lazyggml`` command's entry point (``[project.scripts]`` in pyproject.toml).

A Ctrl-C at any moment of a command ends it with one line on stderr, ``lazyggml: interrupted``,
and exit status 130: never a traceback, never death by the signal. ``lazyggml.cli.main`` says so
for what runs inside it; this module covers the two stretches around it:

* the imports before it. Importing any ``lazyggml`` module runs ``lazyggml/__init__.py`` first,
  which loads NumPy, Numba and every backend (about a second). So the entry point is a module of
  its own, outside the package: its import is light, and the ``try`` below is in place before the
  heavy imports begin. (Only the interpreter's own start-up, the tens of milliseconds before this
  module runs, is left to Python.)
* Python's shutdown after it. While Python joins threads and runs exit callbacks, a
  ``KeyboardInterrupt`` would print a traceback; later, while it tears modules down, Python has
  given SIGINT its default action back, and the process would die by the signal. So once ``main``
  has returned a Ctrl-C ends the process at once, and the last exit callback ends it with
  ``main``'s status before that teardown, which a finished command does not need.
"""
import atexit
import os
import signal
import sys

INTERRUPTED = "lazyggml: interrupted"
_status = None   # main's exit status once it has returned: from then on the process is only ending


def main():
    """Run ``lazyggml.cli.main`` on ``sys.argv``; return its exit status (130 after a Ctrl-C)."""
    global _status
    try:
        from lazyggml.cli import main as cli_main   # the heavy imports
        _status = cli_main()
    except KeyboardInterrupt:   # during the imports (cli.main catches its own)
        print(INTERRUPTED, file=sys.stderr)
        _status = 130
    except SystemExit as e:     # argparse's --help, --version and usage errors: its status, 0 or 2
        _status = e.code
    signal.signal(signal.SIGINT, _interrupted_while_ending)
    return _status


def _interrupted_while_ending(signum, frame):
    """A Ctrl-C after ``main`` returned: what was printed is kept, and the process ends now."""
    sys.stdout.flush()
    if _status != 130:   # else the line was said already
        print(INTERRUPTED, file=sys.stderr, flush=True)
    os._exit(130)


@atexit.register   # registered before any lazyggml module registers its own, so it runs after them all
def _end():
    """End the process with ``main``'s status before Python tears its modules down (see above)."""
    if _status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status)
