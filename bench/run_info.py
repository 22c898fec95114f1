"""What every benchmark table says about its run: the CPU, the scheduling policy, the commit."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sched_policy():
    """The scheduling policy the benchmark ran under (``SCHED_OTHER`` as users run; a table made
    under ``chrt`` says so)."""
    try:
        pol = os.sched_getscheduler(0)
        names = {os.SCHED_OTHER: "SCHED_OTHER", os.SCHED_RR: "SCHED_RR", os.SCHED_FIFO: "SCHED_FIFO"}
        prio = os.sched_getparam(0).sched_priority
        return f"{names.get(pol, pol)} (priority {prio})"
    except (AttributeError, OSError):
        return "unknown"


def git_commit():
    """The short commit measured, marked when the tree differs from it; ``LAZYGGML_COMMIT``
    overrides it (a device machine gets a copy of the tree without its history)."""
    if os.environ.get("LAZYGGML_COMMIT"):
        return os.environ["LAZYGGML_COMMIT"]
    try:
        r = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return (r.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def write_table(path, title, text):
    """Write a result table to ``path`` under ``# title`` and the command line that produced it."""
    with open(path, "w") as f:
        f.write(f"# {title}\n\nProduced by `python {os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)} {' '.join(sys.argv[1:])}`"
                f"\n\n{text}\n")


def end_child(p, timeout):
    """Ask a child engine (``quit`` on its stdin) to end, and kill it if it has not within ``timeout`` s."""
    try:
        p.stdin.write("quit\n")
        p.stdin.close()
    except OSError:
        pass
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
