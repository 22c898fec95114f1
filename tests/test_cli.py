"""The command line: the lines scripts read (the output README documents) and clear errors."""
import re

import pytest

from lazyggml.cli import main


def test_demo_prints_first_token_and_decode_speed(capsys):
    assert main(["demo", "-n", "8", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^first token: \d+\.\d\d s$", out, re.M)
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
    """A bad micro-batch size: one line, exit 1 (a tensor split that does not fit the devices
    raises the same way: test_llama.py); ratios that are not numbers: argparse's usage error."""
    assert main(["demo", "-n", "1", "-ub", "-4"]) == 1
    assert "n_batch must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "-ts", "a,b"])
    assert e.value.code == 2 and "expected numbers separated by commas" in capsys.readouterr().err
