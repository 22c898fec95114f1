"""Every notebook in ``notebooks/`` runs top to bottom, in under two minutes, without an error.

The notebooks check themselves: their cells ``assert`` on the values they print (bit-exactness,
NMSE bounds, split counts...), so a notebook whose story stopped being true fails here. They run
in a fresh Jupyter kernel (nbclient) started from the notebooks folder, importing the same
lazyggml as this test process.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import lazyggml

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
TIME_LIMIT_S = 120


def test_there_are_notebooks():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_", "04_", "05_"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(Path(lazyggml.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=TIME_LIMIT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - t0
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), "a cell did not run"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert elapsed < TIME_LIMIT_S, f"{path.name} took {elapsed:.0f} s"
