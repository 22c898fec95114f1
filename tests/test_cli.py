"""The command line: the lines scripts read (the output README documents) and clear errors."""
import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lazyggml.cli import main


def test_demo_prints_first_token_and_decode_speed(capsys):
    assert main(["demo", "-n", "8", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    # on a cold kernel cache the line says how much of that time went to compiling
    assert re.search(r"^first token: \d+\.\d\d s( \(\d+\.\d\d s of it compiling \d+ kernels\))?$", out, re.M)
    assert re.search(r"^decode: \d+\.\d tokens/s", out, re.M)
    assert out.startswith("loaded ")


def test_graph_demo_matches_numpy(capsys):
    assert main(["graph-demo"]) == 0
    assert "NMSE against float64 NumPy" in capsys.readouterr().out


def test_info_lists_devices_and_support(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "CPU:" in out and "mul_mat q4_K" in out


def test_generate_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing.gguf"), "-n", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lazyggml: error:") and "missing.gguf" in err


def test_bad_offload_options_are_clear_errors(capsys):
    """A bad micro-batch size or ratios that are not numbers: a usage error when parsed, one line,
    exit 2 (load_model's own checks, e.g. a tensor split that does not fit: test_llama.py)."""
    for argv, text in ((["-ub", "-4"], "-ub/--ubatch-size: must be >= 1"),
                       (["-ts", "a,b"], "expected numbers separated by commas")):
        with pytest.raises(SystemExit) as e:
            main(["demo", "-n", "1", *argv])
        assert e.value.code == 2 and text in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["-n", "-5"], "-n/--n-predict"), (["-t", "0"], "-t/--threads"), (["--temp", "-1"], "--temp"),
    (["-ngl", "-3"], "-ngl/--n-gpu-layers"), (["-c", "0"], "-c/--ctx-size"), (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-1"], "--top-k"), (["-ub", "x"], "-ub/--ubatch-size"), (["-n", "1.5"], "-n/--n-predict"),
])
def test_bad_option_values_are_one_line_usage_errors(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"lazyggml: error: argument {option}:")


def test_every_option_has_help():
    from lazyggml.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {a.option_strings or a.dest}" for name, sp in sub.choices.items() for a in sp._actions
               if not isinstance(a, argparse._HelpAction) and not a.help]
    assert missing == []


def test_version(capsys):
    import lazyggml
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"lazyggml {lazyggml.__version__}"


def test_caps_and_stops_are_said(capsys):
    """-t above the usable CPUs and -c above the training context are capped with a note; a
    generation cut short by a full context says so."""
    assert main(["demo", "-n", "100", "-t", "99", "-c", "4096", "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "-t 99 capped to" in err and "-c 4096 capped to 256" in err
    assert main(["demo", "-n", "100", "-c", "16", "--seed", "1"]) == 0
    assert re.search(r"stopped after \d+ of 100 tokens: the context of 16 tokens is full", capsys.readouterr().err)


def test_flash_attention_option(capsys):
    """``-fa on`` (the CPU's default, ``auto``) takes the fused attention, ``-fa off`` the unfused
    one, with the same text (greedy sampling); a wrong value is a usage error."""
    texts = []
    for fa in ("on", "off"):
        assert main(["demo", "-n", "8", "--temp", "0", "-fa", fa]) == 0
        texts.append(capsys.readouterr().out.splitlines()[2])     # the prompt and its continuation
    assert texts[0] == texts[1] and len(texts[0]) > len("And God said")
    with pytest.raises(SystemExit) as e:
        main(["demo", "-fa", "yes"])
    assert e.value.code == 2 and "--flash-attn" in capsys.readouterr().err


def test_device_without_offload_is_an_error(capsys):
    assert main(["demo", "-n", "1", "--device", "CUDA7"]) == 1
    assert "offloads nothing without -ngl" in capsys.readouterr().err


@pytest.mark.parametrize("exc, code, text", [(KeyboardInterrupt(), 130, "lazyggml: interrupted"),
                                             (RuntimeError("device lost"), 1, "lazyggml: error: device lost")])
def test_interrupt_and_runtime_errors_are_one_line(monkeypatch, capsys, exc, code, text):
    import lazyggml.cli as cli

    def fail(args, path=None):
        raise exc
    monkeypatch.setattr(cli, "_generate", fail)
    assert main(["demo", "-n", "1"]) == code
    assert capsys.readouterr().err == text + "\n"


def test_a_first_run_says_kernels_compile_and_leaves_compile_time_out_of_the_speeds(monkeypatch, capsys):
    """What a user sees on a first run: one line saying kernels compile (once, where they are kept,
    that warmup does it ahead), before any output; the prefill and decode speeds exclude the compile
    time and say so. Compiles are stood in for by OpenCL-style ``compiling`` blocks of known length,
    in the prefill and at the first decode step; a warm run says nothing of compiling."""
    import time
    from lazyggml.compiling import compiling
    from lazyggml.models.runner import Model
    orig_eval = Model.eval
    calls = []

    def slow_first_evals(self, tokens, logits_all=True):
        calls.append(len(tokens))
        if len(calls) <= 2:                      # the CLI's decode step, then the prompt
            with compiling(f"kernel{len(calls)}"):
                time.sleep(0.5)
        return orig_eval(self, tokens, logits_all)

    monkeypatch.setattr(Model, "eval", slow_first_evals)
    assert main(["demo", "-n", "4", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert calls[0] == 1 and calls[1] > 1            # one decode step before the prompt
    assert err.count("compiling kernels for this machine, once") == 1 and "lazyggml warmup" in err
    prefill = re.search(r"^prefill: \d+ tokens in (\d+\.\d\d) s \(.*; (\d+\.\d\d) s compiling kernels not counted$",
                        out, re.M)
    assert prefill and float(prefill.group(1)) < 0.5 and float(prefill.group(2)) >= 0.5
    assert re.search(r"^first token: \d+\.\d\d s \(\d+\.\d\d s of it compiling 2 kernels\)$", out, re.M)
    assert "not counted" not in re.search(r"^decode: .*$", out, re.M).group(0)

    calls.clear()
    monkeypatch.setattr(Model, "eval", orig_eval)
    assert main(["demo", "-n", "4", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert "compiling" not in err and "compiling" not in out


# -- Ctrl-C at any moment: the console script in a child process --------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def _console_script(before_main=""):
    """argv of the ``lazyggml`` command as pip installs it: pyproject.toml's entry point, called as
    pip's wrapper script calls it, on this checkout (the child's working directory); the Python
    statements ``before_main`` run between the import and the call. SIGINT first gets the handler
    Python's start-up gives it, which it leaves out where SIGINT is ignored (in a background job)."""
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        module, func = tomllib.load(f)["project"]["scripts"]["lazyggml"].split(":")
    return [sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                                  f"from {module} import {func}; {before_main}sys.exit({func}())"]


def _mapped(pid, name):
    """Whether the process has loaded a shared library whose path contains ``name``."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return name in f.read()
    except OSError:   # it has just ended: the caller sees that
        return False


def _interrupted(argv, moment, timeout=300):
    """Run ``argv``, send SIGINT once ``moment(pid, stdout so far)`` holds; (status, stdout, stderr)."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out, err = [], []
    readers = [threading.Thread(target=lst.extend, args=(pipe,), daemon=True)
               for lst, pipe in ((out, proc.stdout), (err, proc.stderr))]
    for r in readers:
        r.start()
    try:
        deadline = time.monotonic() + timeout
        while not moment(proc.pid, "".join(out)):
            assert proc.poll() is None, f"ended ({proc.returncode}) before the moment:\n{''.join(err)[-3000:]}"
            assert time.monotonic() < deadline, f"no moment within {timeout} s"
            time.sleep(0.002)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    for r in readers:
        r.join(timeout=10)
    return proc.returncode, "".join(out), "".join(err)


@pytest.fixture(scope="module")
def demo_warm():
    """The demo run to its end once (its kernels in the cache), so that a later run says nothing
    on stderr but what the interruption does."""
    r = subprocess.run(_console_script() + ["demo", "-n", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


# in the imports (NumPy's, Numba's), while generating, and after main returned: there an exit
# callback registered after the entry point's, as a module's would be, holds the process
MOMENTS = {
    "importing NumPy": lambda pid, out: _mapped(pid, "_multiarray_umath"),
    "importing Numba": lambda pid, out: _mapped(pid, "llvmlite"),
    "generating": lambda pid, out: "\nlayers: " in out,
    "exiting": lambda pid, out: "exiting" in out,
}
HOLD_AT_EXIT = "import atexit, time; atexit.register(time.sleep, 60); atexit.register(print, 'exiting'); "


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="watches the child's libraries in /proc")
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(demo_warm, moment):
    argv = _console_script(HOLD_AT_EXIT if moment == "exiting" else "")
    status, out, err = _interrupted(argv + ["demo", "-n", "200", "--temp", "0"], MOMENTS[moment])
    assert status == 130 and err.splitlines() == ["lazyggml: interrupted"], (status, err[-3000:])
    if moment == "exiting":   # what was printed before is kept
        assert "\ndecode: " in out


# -- README's test command -------------------------------------------------------------------------------
def test_a_llama_cpp_without_rpc_stops_the_test_run_at_once_with_one_line(tmp_path):
    """tests/conftest.py: a llama-cpp-python without its RPC backend (here a stand-in package with its
    libraries but not libggml-rpc) stops the run before any test, saying what to run."""
    lib = tmp_path / "llama_cpp" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "llama_cpp" / "__init__.py").write_text("")
    (lib / "libggml.so").write_bytes(b"")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cli.py::test_version"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and r.stdout == "" and len(lines) == 1, (r.returncode, r.stdout, r.stderr)
    assert "RPC backend" in lines[0] and "pip uninstall -y llama-cpp-python" in lines[0] \
        and "pip cache remove llama_cpp_python" in lines[0] and "test command" in lines[0]
