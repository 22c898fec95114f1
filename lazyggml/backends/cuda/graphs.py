"""CUDA graphs: record a split's kernel launches once, then replay them with one driver call.

numba-cuda spends tens of microseconds of host time per kernel launch, while a decode step's
kernels each run for a few microseconds: launched one by one, a layer stack is bound by Python.
A CUDA graph fixes that as GGML does (``GGML_CUDA_GRAPHS``): the backend runs a split's launches
on its stream while the stream is *capturing* (``cuStreamBeginCapture`` on the numba stream's
handle; the launches are recorded, not run), ends the capture (``cuStreamEndCapture`` gives a
graph), instantiates it once (``cuGraphInstantiate``) and from then on replays it with
``cuGraphLaunch``, at no per-kernel host cost. Kernel arguments, device pointers included, are
frozen into the graph, so a replay is only valid while every tensor sits where it sat at capture:
the backend keys each graph by the nodes' ops, shapes, strides, buffers and offsets.

Capture runs in relaxed mode, so numba's own bookkeeping calls (context queries) stay legal. Every
kernel must already be compiled before it is captured: the backend runs a graph eagerly the first
time it sees it and captures it the second time.
"""
from __future__ import annotations

import atexit
import weakref

_live = weakref.WeakSet()   # instantiated graphs not yet freed


@atexit.register
def _free_live_graphs():
    """Free every graph while the driver and contexts are still up: left to the garbage collector
    at interpreter exit, a graph can outlive its context (seen as a glibc abort with two GPUs).
    Registered after numba's own exit handlers, so it runs before them."""
    for g in list(_live):
        g.free()


def _driver():
    from cuda.bindings import driver
    return driver


def _check(result, what):
    err = result[0]
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err!r}")
    return result[1] if len(result) > 1 else None


def _stream(stream):
    return _driver().CUstream(int(stream.handle))


class CudaGraph:
    """An instantiated CUDA graph (``CUgraphExec``) and the graph it was made from."""

    def __init__(self, graph, exec_):
        self.graph = graph
        self.exec = exec_
        _live.add(self)

    def launch(self, stream):
        _check(_driver().cuGraphLaunch(self.exec, _stream(stream)), "cuGraphLaunch")

    def free(self):
        drv = _driver()
        if self.exec is not None:
            drv.cuGraphExecDestroy(self.exec)
            drv.cuGraphDestroy(self.graph)
            self.exec = self.graph = None

    def __del__(self):
        try:
            self.free()
        except Exception:   # interpreter shutdown: the driver may already be gone
            pass


def capture(stream, record):
    """Call ``record()`` (which launches kernels on ``stream``) under capture; return a CudaGraph."""
    drv = _driver()
    h = _stream(stream)
    _check(drv.cuStreamBeginCapture(h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
           "cuStreamBeginCapture")
    try:
        record()
    except BaseException:
        graph = drv.cuStreamEndCapture(h)[1]
        if graph:
            drv.cuGraphDestroy(graph)
        raise
    graph = _check(drv.cuStreamEndCapture(h), "cuStreamEndCapture")
    return CudaGraph(graph, _check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate"))
