"""The scheduler (docs/graph-alloc-sched.md §6), against mock backends (docs/graph-alloc-sched.md §8) and, for the
numbers, against the real CPU backend plus a second CPU-backed device with its own non-host memory.

Mock conventions (docs/graph-alloc-sched.md §8): GPU, GPU0, GPU1 own a non-host buft each and accept only it; CPU owns a
host buft and accepts any host buft; ACCEL uses the very same buft object as CPU. Buffers are real
host memory; ``synchronize`` logs ``sync`` and ``graph_compute`` logs ``compute[names...]``.
"""
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import lazyggml as lg
from lazyggml.alloc import alloc_ctx_tensors_from_buft
from lazyggml.backend import Backend, Device, DeviceType
from lazyggml.buffer import Buffer, BufferType, BufferUsage, Status
from lazyggml.backends.cpu import cpu_device
from lazyggml.ops import Op
from lazyggml.sched import Scheduler, fmt_size
from lazyggml.testing import StandInDevice

GPU_T, CPU_T, ACCEL_T = DeviceType.GPU, DeviceType.CPU, DeviceType.ACCEL
IO = lg.FLAG_INPUT | lg.FLAG_OUTPUT


# -- mock backends -----------------------------------------------------------------------------------
class MockEvent:
    def __init__(self, device):
        self.device = device


class MockDevice(Device):
    def __init__(self, name, type_, buft=None, ops=None, offload=(), events=False):
        super().__init__(name, type=type_)
        self.buft = buft if buft is not None else BufferType(f"{name}_buf", self, 32, host=type_ == CPU_T)
        self.ops = ops            # None: every op
        self.offload = set(offload)
        self.events = events
        self.log = []             # shared with its backend, so event calls land in the same log

    def get_buffer_type(self):
        return self.buft

    def supports_buft(self, buft):
        return buft is self.buft if self.type == GPU_T else buft.is_host()

    def supports_op(self, t):
        return self.ops is None or t.op in self.ops

    def offload_op(self, t):
        return t.op in self.offload

    def init_backend(self):
        return MockBackend(self)

    def event_new(self):
        return MockEvent(self) if self.events else None

    def event_synchronize(self, event):
        self.log.append("esync")


class MockBackend(Backend):
    def __init__(self, device):
        super().__init__(device)
        self.log = device.log
        if device.events:
            self.event_record = lambda e: self.log.append("record")
            self.event_wait = lambda e: self.log.append("wait")

    def synchronize(self):
        self.log.append("sync")

    def graph_compute(self, g):
        self.log.append("compute[" + ",".join(n.name for n in g.nodes) + "]")
        return Status.SUCCESS


def mocks(*names, gpu_ops=None, offload=(), events=False):
    """Backends by name, in the order given (the CPU one must come last)."""
    cpu = MockDevice("CPU", CPU_T, events=events)
    out = []
    for n in names:
        if n == "CPU":
            dev = cpu
        elif n == "ACCEL":
            dev = MockDevice("ACCEL", ACCEL_T, buft=cpu.buft, ops={Op.MUL_MAT, Op.UNARY, Op.NONE}, events=events)
        else:
            dev = MockDevice(n, GPU_T, ops=gpu_ops, offload=offload, events=events)
        out.append(dev.init_backend())
    return out


def logs(*backends):
    return {b.name: " ".join(b.log) for b in backends}


def clear(*backends):
    for b in backends:
        b.log.clear()


# -- graphs ---------------------------------------------------------------------------------------------
def named(t, name):
    t.name = name
    return t


def weights(specs):
    """``specs``: (name, ne, backend) triples. Each backend's tensors live in one WEIGHTS buffer of
    its default buft (docs/graph-alloc-sched.md §8's "weights @B")."""
    ctxs, out = {}, {}
    for name, ne, b in specs:
        ctx = ctxs.setdefault(b, lg.Context())
        out[name] = named(ctx.new_tensor(lg.F32, ne), name)
    for b, ctx in ctxs.items():
        alloc_ctx_tensors_from_buft(ctx, b.get_default_buffer_type()).usage = BufferUsage.WEIGHTS
    return out


def mlp_weights(layer_backends, n=64):
    specs = []
    for i, b in enumerate(layer_backends):
        specs += [(f"W{i}", (n, n), b), (f"B{i}", (n,), b)]
    return weights(specs)


def mlp(w, n_layers, n=64, n_tok=4):
    """The standard MLP of docs/graph-alloc-sched.md §8: ``h_i = relu(W_i h + B_i)`` on the INPUT ``x`` [n, n_tok]."""
    ctx = lg.Context()
    x = named(ctx.new_tensor_2d(lg.F32, n, n_tok), "x")
    lg.set_input(x)
    h = x
    for i in range(n_layers):
        m = named(lg.mul_mat(w[f"W{i}"], h), f"m{i}")
        a = named(lg.add(m, w[f"B{i}"]), f"a{i}")
        h = named(lg.relu(a), f"h{i}")
    lg.set_output(h)
    g = lg.Graph()
    lg.build_forward_expand(g, h)
    return g, {t.name: t for t in g.nodes + g.leafs}


def graph_of(out):
    g = lg.Graph()
    lg.build_forward_expand(g, out)
    return g


def new_input(name, ne):
    t = named(lg.Context().new_tensor(lg.F32, ne), name)
    lg.set_input(t)
    return t


def where(s, t):
    b = s.get_tensor_backend(t)
    return b.name if b is not None else None


def split_list(s):
    return [(s.backends[sp.backend_id].name, sp.i_start, sp.i_end, [t.name for t in sp.inputs]) for sp in s.splits]


def place(t):
    """(buffer type name, offset) of an allocated tensor."""
    return (t.buffer.buft.name, t.offset)


# -- construction -----------------------------------------------------------------------------------------
def test_construction_checks():
    gpu, cpu = mocks("GPU", "CPU")
    with pytest.raises(ValueError, match="1 to 16 backends"):
        Scheduler([])
    with pytest.raises(ValueError, match="1 to 16 backends"):
        Scheduler(mocks(*[f"GPU{i}" for i in range(16)], "CPU"))
    with pytest.raises(ValueError, match="last backend must be a CPU"):
        Scheduler([cpu, gpu])
    with pytest.raises(ValueError, match="does not support buffer type GPU_buf"):
        Scheduler([gpu, cpu], bufts=[gpu.get_default_buffer_type(), gpu.get_default_buffer_type()])
    s = Scheduler([gpu, cpu])
    assert (s.n_backends, s.get_n_backends(), s.n_copies, s.get_n_copies()) == (2, 2, 1, 1)
    assert s.get_backend(0) is gpu and s.get_backend(1) is cpu
    with pytest.raises(ValueError):
        s.get_backend(2)
    assert s.get_buffer_type(cpu) is cpu.get_default_buffer_type()
    assert s.events == [[None], [None]]


def test_events_per_backend_and_copy_only_when_parallel():
    gpu, cpu = mocks("GPU", "CPU", events=True)
    assert Scheduler([gpu, cpu]).events == [[None], [None]]
    s = Scheduler([gpu, cpu], parallel=True)
    assert s.n_copies == 4
    assert [[e.device for e in row] for row in s.events] == [[gpu.device] * 4, [cpu.device] * 4]
    assert len({id(e) for row in s.events for e in row}) == 8


# -- T24: partial offload of a 4-layer MLP ----------------------------------------------------------------
def test_t24a_gpu_then_cpu():
    gpu, cpu = mocks("GPU", "CPU")
    w = mlp_weights([gpu, gpu, cpu, cpu])
    g, t = mlp(w, 4)
    assert [n.name for n in g.nodes] == ["m0", "a0", "h0", "m1", "a1", "h1", "m2", "a2", "h2", "m3", "a3", "h3"]
    assert [n.name for n in g.leafs] == ["W3", "W2", "W1", "W0", "x", "B0", "B1", "B2", "B3"]
    s = Scheduler([gpu, cpu])
    h1 = t["h1"]
    assert s.alloc_graph(g)

    assert {n: where(s, t[n]) for n in t} == {
        **{n: "GPU" for n in ["m0", "a0", "h0", "m1", "a1", "h1", "W0", "W1", "B0", "B1"]},
        **{n: "CPU" for n in ["m2", "a2", "h2", "m3", "a3", "h3", "W2", "W3", "B2", "B3", "x"]}}
    assert s.get_tensor_cause(t["h0"]) == "2.sup" and s.get_tensor_cause(t["h2"]) == "2.sup"
    assert split_list(s) == [("GPU", 0, 6, ["x"]), ("CPU", 6, 12, ["h1"])]
    assert s.n_splits == s.get_n_splits() == 2
    x_gpu, h1_cpu = s.get_tensor_copy(t["x"], 0, 0), s.get_tensor_copy(h1, 1, 0)
    assert (x_gpu.name, h1_cpu.name) == ("GPU#x#0", "CPU#h1#0")
    assert t["m0"].src[1] is x_gpu and t["m2"].src[1] is h1_cpu
    assert h1_cpu.flags == 0 and s.get_tensor_backend(h1_cpu) is None

    assert s.get_buffer_size(gpu) == 2048 and s.get_buffer_size(cpu) == 2048
    assert place(x_gpu) == ("GPU_buf", 0)
    assert {n: place(t[n]) for n in ["m0", "a0", "h0", "m1", "a1", "h1"]} == {
        "m0": ("GPU_buf", 1024), "a0": ("GPU_buf", 1024), "h0": ("GPU_buf", 1024),
        "m1": ("GPU_buf", 0), "a1": ("GPU_buf", 0), "h1": ("GPU_buf", 0)}
    # x's memory is reused by the copy of h1: x dies right after its dependency node
    assert place(t["x"]) == ("CPU_buf", 0) and place(h1_cpu) == ("CPU_buf", 0)
    assert {n: place(t[n]) for n in ["m2", "a2", "h2", "m3", "a3", "h3"]} == {
        "m2": ("CPU_buf", 1024), "a2": ("CPU_buf", 1024), "h2": ("CPU_buf", 1024),
        "m3": ("CPU_buf", 0), "a3": ("CPU_buf", 0), "h3": ("CPU_buf", 0)}

    clear(gpu, cpu)
    assert s.graph_compute(g) == Status.SUCCESS
    assert logs(gpu, cpu) == {"GPU": "sync compute[m0,a0,h0,m1,a1,h1] sync sync",
                              "CPU": "sync sync compute[m2,a2,h2,m3,a3,h3] sync"}


def test_t24b_cpu_then_gpu():
    gpu, cpu = mocks("GPU", "CPU")
    w = mlp_weights([cpu, cpu, gpu, gpu])
    g, t = mlp(w, 4)
    s = Scheduler([gpu, cpu])
    assert s.alloc_graph(g)
    assert [n for n in ["m0", "a0", "h0", "m1", "a1"] if where(s, t[n]) != "CPU"] == []
    assert [n for n in ["h1", "m2", "a2", "h2", "m3", "a3", "h3"] if where(s, t[n]) != "GPU"] == []
    assert split_list(s) == [("CPU", 0, 5, []), ("GPU", 5, 12, ["a1"])]
    assert t["h1"].src[0] is s.get_tensor_copy(t["a1"], 0, 0) and t["h1"].src[0].name == "GPU#a1#0"
    assert s.get_buffer_size(gpu) == 2048 and s.get_buffer_size(cpu) == 2048
    clear(gpu, cpu)
    s.graph_compute(g)
    assert logs(gpu, cpu) == {"GPU": "sync sync compute[h1,m2,a2,h2,m3,a3,h3] sync",
                              "CPU": "compute[m0,a0,h0,m1,a1] sync sync"}


# -- debug output (T25's format) -----------------------------------------------------------------------------
def t25_graph(gpu):
    """x -> m0 = W0 x -> a0 = m0 + B0 -> s0 = soft_max(a0) -> r0 = relu(s0); GPU can't SOFT_MAX."""
    w = weights([("W0", (64, 64), gpu), ("B0", (64,), gpu)])
    x = new_input("x", (64, 4))
    m0 = named(lg.mul_mat(w["W0"], x), "m0")
    a0 = named(lg.add(m0, w["B0"]), "a0")
    s0 = named(lg.soft_max(a0), "s0")
    r0 = named(lg.relu(s0), "r0")
    lg.set_output(r0)
    return graph_of(r0), dict(x=x, m0=m0, a0=a0, s0=s0, r0=r0, **w)


def blank_causes(line):
    """GGML release prints 8 blanks where lazyggml prints the cause."""
    return re.sub(r"(\[[ A-Za-z0-9]{5}) [ .a-z0-9]{8}\]", lambda m: m.group(1) + " " * 9 + "]", line)


def test_debug_lines_t25_format(caplog):
    gpu, cpu = mocks("GPU", "CPU", gpu_ops=set(Op) - {Op.SOFT_MAX})
    g, t = t25_graph(gpu)
    s = Scheduler([gpu, cpu])
    s.debug = 2
    with caplog.at_level(logging.DEBUG, logger="lazyggml"):
        s.alloc_graph(g)
    lines = [r.getMessage() for r in caplog.records if r.name == "lazyggml"]
    assert lines == [
        "\n## SPLIT #0: GPU # 1 inputs: [x (   1K)] ",
        "node #  0 (   MUL_MAT):                   m0 (   1K) [  GPU   1.wgt0] use=1,c=1:"
        "                   W0 (  16K) [  GPU    1.dst]              GPU#x#0 (   1K) [ NULL    4.cpy]",
        "node #  1 (       ADD):                   a0 (   1K) [  GPU   1.wgt1] use=1,c=1:"
        "                   m0 (   1K) [  GPU   1.wgt0]                   B0 (   0K) [  GPU    1.dst]",
        "\n## SPLIT #1: CPU # 1 inputs: [a0 (   1K)] ",
        "node #  2 (  SOFT_MAX):                   s0 (   1K) [  CPU   3.best] use=1,c=1:"
        "             CPU#a0#0 (   1K) [ NULL    4.cpy]",
        "\n## SPLIT #2: GPU # 1 inputs: [s0 (   1K)] ",
        "node #  3 (      RELU):                   r0 (   1K) [  GPU    2.sup] use=0,c=1:"
        "             GPU#s0#0 (   1K) [ NULL    4.cpy]",
    ]
    # with the causes blanked, the lines are GGML's own (docs/graph-alloc-sched.md §6.8, T25)
    assert lines[3] + "\n" + blank_causes(lines[4]) == (
        "\n## SPLIT #1: CPU # 1 inputs: [a0 (   1K)] \n"
        "node #  2 (  SOFT_MAX):                   s0 (   1K) [  CPU         ] use=1,c=1:"
        "             CPU#a0#0 (   1K) [ NULL         ]")

    caplog.clear()
    s.reset()
    s.debug = 1  # headers only
    g, _ = t25_graph(gpu)
    with caplog.at_level(logging.DEBUG, logger="lazyggml"):
        s.alloc_graph(g)
    assert [r.getMessage() for r in caplog.records] == [
        "\n## SPLIT #0: GPU # 1 inputs: [x (   1K)] ", "\n## SPLIT #1: CPU # 1 inputs: [a0 (   1K)] ",
        "\n## SPLIT #2: GPU # 1 inputs: [s0 (   1K)] "]


def test_fmt_size():
    sizes = (256, 1024, 25600, 1048575, 1048576, 5 << 20)
    assert [fmt_size(n) for n in sizes] == ["0K", "1K", "25K", "1023K", "1M", "5M"]


def test_debug_env_prints_to_stderr():
    """With LAZYGGML_SCHED_DEBUG set and no logging configured, the listing reaches stderr as is."""
    script = (
        "import sys; sys.path.insert(0, %r)\n"
        "import test_sched as T\n"
        "gpu, cpu = T.mocks('GPU', 'CPU')\n"
        "g, t = T.mlp(T.mlp_weights([cpu, cpu]), 2)\n"
        "T.Scheduler([gpu, cpu]).alloc_graph(g)\n" % os.path.dirname(__file__))
    root = os.path.dirname(os.path.dirname(lg.__file__))
    env = dict(os.environ, LAZYGGML_SCHED_DEBUG="2",
               PYTHONPATH=os.pathsep.join([root] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ("\n## SPLIT #0: CPU # 0 inputs\nnode #  0 (   MUL_MAT):                   m0 (   1K) "
            "[  CPU   1.wgt0] use=1,c=1:                   W0 (  16K) [  CPU    1.dst]") in r.stderr
    assert r.stderr.count("\nnode #") == 6


# -- pass 1 ---------------------------------------------------------------------------------------------------
def test_weights_pull_ops_and_op_offload():
    gpu, cpu = mocks("GPU", "CPU", offload={Op.MUL_MAT})
    w = weights([("W", (64, 64), cpu), ("B", (64,), cpu)])
    for op_offload, m_where, m_cause in ((True, "GPU", "1.off"), (False, "CPU", "1.wgt0")):
        x = new_input("x", (64, 4))
        m = named(lg.mul_mat(w["W"], x), "m")
        a = named(lg.add(m, w["B"]), "a")
        s = Scheduler([gpu, cpu], op_offload=op_offload)
        s.alloc_graph(graph_of(a))
        assert (where(s, m), s.get_tensor_cause(m)) == (m_where, m_cause)
        assert (where(s, a), s.get_tensor_cause(a)) == ("CPU", "1.wgt1")  # the GPU won't offload ADD
        assert (where(s, x), s.get_tensor_cause(x)) == ("CPU", "1.inp")
        assert (where(s, w["W"]), s.get_tensor_cause(w["W"])) == ("CPU", "1.dst")


def test_only_weights_buffers_attract_ops():
    gpu, cpu = mocks("GPU", "CPU")
    ctx = lg.Context()
    kv = named(ctx.new_tensor_2d(lg.F32, 64, 4), "kv")  # a GPU tensor that is not a weight
    alloc_ctx_tensors_from_buft(ctx, gpu.get_default_buffer_type())
    w = weights([("B", (64,), cpu)])
    x = new_input("x", (64, 4))
    a = named(lg.add(x, w["B"]), "a")   # CPU: its weight
    k = named(lg.mul(a, kv), "k")       # no weight: left to the expansion, which extends CPU
    s = Scheduler([gpu, cpu])
    s.alloc_graph(graph_of(k))
    assert (where(s, kv), s.get_tensor_cause(kv)) == ("GPU", "1.dst")
    assert (where(s, k), s.get_tensor_cause(k)) == ("CPU", "2.sup")
    assert k.src[1].name == "CPU#kv#0"


def test_preallocated_tensor_nobody_can_run_raises():
    gpu, cpu = mocks("GPU", "CPU")
    npu = MockDevice("NPU", GPU_T).init_backend()  # not in the scheduler
    w = weights([("W", (64, 64), npu)])
    x = new_input("x", (64, 4))
    s = Scheduler([gpu, cpu])
    with pytest.raises(ValueError, match=r"^pre-allocated tensor \(W\) in a buffer \(NPU_buf\) that cannot "
                                         r"run the operation \(NONE\)$"):
        s.alloc_graph(graph_of(lg.mul_mat(w["W"], x)))

    gpu, cpu = mocks("GPU", "CPU", gpu_ops=set(Op) - {Op.SOFT_MAX})
    a = new_input("a", (64, 4))
    sm = named(lg.soft_max(a), "sm")  # its result is meant to land in a GPU buffer
    buf = gpu.get_default_buffer_type().alloc_buffer(1024)
    lg.tensor_alloc(buf, sm, 0)
    with pytest.raises(ValueError, match=r"pre-allocated tensor \(sm\) in a buffer \(GPU_buf\) that cannot "
                                         r"run the operation \(SOFT_MAX\)"):
        Scheduler([gpu, cpu]).alloc_graph(graph_of(sm))


def test_user_assignment_is_kept():
    gpu, cpu = mocks("GPU", "CPU")
    g, t = mlp(mlp_weights([gpu, gpu]), 2)
    s = Scheduler([gpu, cpu])
    s.set_tensor_backend(t["h0"], cpu)
    assert where(s, t["h0"]) == "CPU" and s.get_tensor_cause(t["h0"]) == "usr"
    s.alloc_graph(g)
    assert where(s, t["h0"]) == "CPU" and s.get_tensor_cause(t["h0"]) == "usr"
    assert split_list(s) == [("GPU", 0, 2, ["x"]), ("CPU", 2, 3, ["a0"]), ("GPU", 3, 6, ["h0"])]
    with pytest.raises(ValueError, match="not in this scheduler"):
        s.set_tensor_backend(t["h0"], mocks("GPU")[0])
    s.reset()
    assert s.get_tensor_backend(t["h0"]) is None


# -- pass 2 ------------------------------------------------------------------------------------------------------
def test_expansion_jumps_unsupported_node_and_ignores_views():
    gpu, cpu = mocks("GPU", "CPU", gpu_ops=set(Op) - {Op.SOFT_MAX})
    g, t = t25_graph(gpu)
    s = Scheduler([gpu, cpu])
    s.alloc_graph(g)
    # r0 is reached by the GPU-down sweep across the unsupported s0
    assert (where(s, t["r0"]), s.get_tensor_cause(t["r0"])) == ("GPU", "2.sup")
    assert (where(s, t["s0"]), s.get_tensor_cause(t["s0"])) == ("CPU", "3.best")
    assert split_list(s) == [("GPU", 0, 2, ["x"]), ("CPU", 2, 3, ["a0"]), ("GPU", 3, 4, ["s0"])]
    assert t["r0"].src[0].name == "GPU#s0#0"

    # a view op between two nodes neither takes nor stops the propagation; it follows its root later
    gpu, cpu = mocks("GPU", "CPU")
    w = weights([("W", (64, 64), gpu)])
    m = named(lg.mul_mat(w["W"], new_input("x", (64, 4))), "m")
    v = named(lg.reshape_2d(m, 128, 2), "v")
    r = named(lg.relu(v), "r")
    s = Scheduler([gpu, cpu])
    s.alloc_graph(graph_of(r))
    assert (where(s, r), s.get_tensor_cause(r)) == ("GPU", "2.sup")
    assert (where(s, v), s.get_tensor_cause(v)) == ("GPU", "4.vsrc")
    assert split_list(s) == [("GPU", 0, 3, ["x"])]


def test_gpu_regions_grow_before_cpu_regions():
    # T24b in miniature: a node between a CPU and a GPU region joins the GPU (sweep b before c)
    gpu, cpu = mocks("GPU", "CPU")
    w = weights([("B0", (64,), cpu), ("B1", (64,), gpu)])
    x = new_input("x", (64, 4))
    a = named(lg.add(x, w["B0"]), "a")
    r = named(lg.relu(a), "r")
    b = named(lg.add(r, w["B1"]), "b")
    s = Scheduler([gpu, cpu])
    s.alloc_graph(graph_of(b))
    assert [where(s, n) for n in (a, r, b)] == ["CPU", "GPU", "GPU"]


# -- pass 3 ------------------------------------------------------------------------------------------------------
def test_upgrade_to_accel_sharing_the_cpu_buft():
    accel, cpu = mocks("ACCEL", "CPU")
    assert accel.get_default_buffer_type() is cpu.get_default_buffer_type()
    w = weights([("B", (64,), cpu)])
    x = new_input("x", (64, 4))
    a = named(lg.add(x, w["B"]), "a")  # ACCEL can read B but can't ADD
    r = named(lg.relu(a), "r")
    lg.set_output(r)
    g = graph_of(r)
    s = Scheduler([accel, cpu])
    assert s.alloc_graph(g)
    assert (where(s, a), s.get_tensor_cause(a)) == ("CPU", "1.wgt1")
    assert (where(s, r), s.get_tensor_cause(r)) == ("ACCEL", "3.upg")
    assert split_list(s) == [("CPU", 0, 1, []), ("ACCEL", 1, 2, [])]  # no copy: same memory
    assert r.src[0] is a
    # one buffer for both: the higher-priority ACCEL reports it, the CPU 0 (x, a, r all in place)
    assert (s.get_buffer_size(accel), s.get_buffer_size(cpu)) == (1024, 0)
    assert place(x) == place(a) == place(r) == ("CPU_buf", 0)

    def fresh():
        r = named(lg.relu(named(lg.add(new_input("x", (64, 4)), w["B"]), "a")), "r")
        lg.set_output(r)
        return graph_of(r)

    assert s.reserve_size(fresh()) == [1024, 1024]  # the plan only: each id reports the shared total

    # a split without inputs after a backend change waits for the previous backend first
    clear(accel, cpu)
    s.reset()
    s.graph_compute(fresh())
    assert logs(accel, cpu) == {"ACCEL": "compute[r] sync", "CPU": "compute[a] sync sync"}


def test_best_backend_by_supported_inputs():
    def build(with_mask):
        gpu0, gpu1, cpu = mocks("GPU0", "GPU1", "CPU")
        gpu1.device.ops = set(Op) - {Op.SOFT_MAX}
        w = weights([("W", (64, 64), gpu1)])
        q = named(lg.mul_mat(w["W"], new_input("x", (64, 4))), "q")
        mask = new_input("mask", (64, 4)) if with_mask else None
        sm = named(lg.soft_max_ext(q, mask), "sm")
        r = named(lg.relu(sm), "r")
        s = Scheduler([gpu0, gpu1, cpu])
        s.alloc_graph(graph_of(r))
        return s, q, sm, r

    # nobody can read q where it is: a tie at 0, the highest priority wins
    s, q, sm, r = build(False)
    assert (where(s, q), where(s, sm), s.get_tensor_cause(sm), where(s, r)) == ("GPU1", "GPU0", "3.best", "GPU1")
    # the CPU can read the mask (an input on the CPU), so it has the most supported inputs
    s, q, sm, r = build(True)
    assert (where(s, sm), s.get_tensor_cause(sm)) == ("CPU", "3.best")
    assert split_list(s) == [("GPU1", 0, 1, ["x"]), ("CPU", 1, 2, ["q"]), ("GPU1", 2, 3, ["sm"])]


# -- pass 4 ------------------------------------------------------------------------------------------------------
def test_unassigned_leaf_lands_on_its_first_consumer():
    gpu, cpu = mocks("GPU", "CPU")
    w = weights([("Wg", (64, 64), gpu), ("Wc", (64, 64), cpu)])
    c = named(lg.Context().new_tensor_2d(lg.F32, 64, 4), "c")  # no buffer, not an input
    m0 = named(lg.mul_mat(w["Wg"], new_input("x", (64, 4))), "m0")
    a0 = named(lg.add(m0, c), "a0")
    m1 = named(lg.mul_mat(w["Wc"], a0), "m1")
    a1 = named(lg.add(m1, c), "a1")
    s = Scheduler([gpu, cpu])
    s.alloc_graph(graph_of(a1))
    assert (where(s, c), s.get_tensor_cause(c)) == ("GPU", "4.cur")
    assert c.buffer.buft.name == "GPU_buf"  # allocated with the GPU's compute buffer
    assert split_list(s) == [("GPU", 0, 2, ["x"]), ("CPU", 2, 4, ["a0", "c"])]
    assert a1.src[1].name == "CPU#c#0"


# -- pass 5 ------------------------------------------------------------------------------------------------------
def test_forced_split_per_offloaded_weight():
    gpu, cpu = mocks("GPU", "CPU", offload={Op.MUL_MAT})
    w = weights([(f"W{i}", (64, 64), cpu) for i in range(3)])
    h = new_input("x", (64, 4))
    for i in range(3):
        h = named(lg.relu(named(lg.mul_mat(w[f"W{i}"], h), f"m{i}")), f"r{i}")
    g = graph_of(h)
    s = Scheduler([gpu, cpu])
    s.alloc_graph(g)
    assert split_list(s) == [("GPU", 0, 2, ["W0", "x"]), ("GPU", 2, 4, ["W1"]), ("GPU", 4, 6, ["W2"])]
    copies = [s.get_tensor_copy(w[f"W{i}"], 0, 0) for i in range(3)]
    # each weight's copy takes the memory of the previous one
    assert [place(c) for c in copies] == [("GPU_buf", 0)] * 3
    assert s.get_buffer_size(gpu) == 16384 + 2 * 1024


def test_copy_made_once_per_backend_for_the_whole_graph():
    gpu, cpu = mocks("GPU", "CPU")
    w = weights([("Wg0", (64, 64), gpu), ("Wc", (64, 64), cpu), ("Wg2", (64, 64), gpu)])
    x = new_input("x", (64, 4))
    m0 = named(lg.mul_mat(w["Wg0"], x), "m0")
    m1 = named(lg.mul_mat(w["Wc"], m0), "m1")
    m2 = named(lg.mul_mat(w["Wg2"], m1), "m2")
    a2 = named(lg.add(m2, x), "a2")  # x again, in a later GPU split
    s = Scheduler([gpu, cpu])
    s.alloc_graph(graph_of(a2))
    assert split_list(s) == [("GPU", 0, 1, ["x"]), ("CPU", 1, 2, ["m0"]), ("GPU", 2, 4, ["m1"])]
    assert a2.src[1] is m0.src[1] is s.get_tensor_copy(x, 0, 0)
    # and the copy stays alive until its last reader
    assert place(m0.src[1]) == ("GPU_buf", 0)
    assert 0 not in (m0.offset, m2.offset, a2.offset, s.get_tensor_copy(m1, 0, 0).offset)


def test_copies_keep_the_layout_of_a_transposed_input():
    gpu, cpu = mocks("GPU", "CPU")
    w = weights([("W", (64, 64), gpu)])
    x = new_input("x", (4, 64))
    xt = named(lg.transpose(x), "xt")  # a view: stays with x on the CPU
    m = named(lg.mul_mat(w["W"], xt), "m")
    s = Scheduler([gpu, cpu])
    s.alloc_graph(graph_of(m))
    cpy = m.src[1]
    assert (cpy.name, cpy.ne, cpy.nb) == ("GPU#xt#0", xt.ne, xt.nb)
    assert where(s, xt) == "CPU" and split_list(s) == [("GPU", 0, 2, ["xt"])]


def test_split_input_capacity_forces_a_split(caplog):
    # a GPU chain adding one CPU input per node: the split fills its 30 input slots, the next
    # node that needs a new input starts a split
    gpu, cpu = mocks("GPU", "CPU")
    w = weights([("W", (64, 64), gpu)])
    h = named(lg.mul_mat(w["W"], new_input("x0", (64, 4))), "m")
    for i in range(1, 33):
        h = named(lg.add(h, new_input(f"x{i}", (64, 4))), f"a{i}")
    s = Scheduler([gpu, cpu])
    s.alloc_graph(graph_of(h))
    assert [(sp[0], len(sp[3])) for sp in split_list(s)] == [("GPU", 30), ("GPU", 3)]

    # the check runs before a node, so a node bringing two new inputs at 29 overshoots: the list grows
    h = named(lg.mul_mat(w["W"], new_input("x0", (64, 4))), "m")
    for i in range(1, 29):
        h = named(lg.add(h, new_input(f"x{i}", (64, 4))), f"a{i}")
    p = named(lg.add(new_input("xa", (64, 4)), new_input("xb", (64, 4))), "p")
    out = named(lg.add(h, p), "out")
    s.reset()
    with caplog.at_level(logging.WARNING, logger="lazyggml"):
        s.alloc_graph(graph_of(out))
    assert [(sp[0], len(sp[3])) for sp in split_list(s)] == [("GPU", 31)]
    assert "increasing split inputs capacity from 30 to 60" in caplog.text


# -- parallel: 4 copy slots -----------------------------------------------------------------------------------------
def test_parallel_copy_slots():
    gpu, cpu = mocks("GPU", "CPU")
    w = mlp_weights([gpu, gpu, cpu, cpu])
    s = Scheduler([gpu, cpu], parallel=True)
    assert s.n_copies == 4
    seen = []
    for k in range(6):
        g, t = mlp(w, 4)
        x, h1 = t["x"], t["h1"]
        assert s.alloc_graph(g)
        cur = k % 4
        assert (s.cur_copy, s.next_copy) == (cur, (cur + 1) % 4)
        assert s.graph_inputs == [x]
        # the graph input's current slot is the tensor itself; the others are CPU#x#c
        slots = [s.get_tensor_copy(x, 1, c) for c in range(4)]
        assert slots[cur] is x
        assert [c.name for i, c in enumerate(slots) if i != cur] == [f"CPU#x#{i}" for i in range(4) if i != cur]
        gpu_x = [s.get_tensor_copy(x, 0, c) for c in range(4)]
        cpu_h1 = [s.get_tensor_copy(h1, 1, c) for c in range(4)]
        assert [c.name for c in gpu_x] == [f"GPU#x#{c}" for c in range(4)]
        assert all(c.flags & IO == IO for c in slots + gpu_x + cpu_h1)
        assert t["m0"].src[1] is gpu_x[cur] and t["m2"].src[1] is cpu_h1[cur]
        # every slot has its own memory, never reused
        assert len({c.offset for c in gpu_x}) == 4 and len({c.offset for c in slots + cpu_h1}) == 8
        seen.append(t["m0"].src[1].name)
        s.graph_compute(g)
        assert s.next_copy == (cur + 1) % 4  # synchronize while allocated keeps the slot
        s.reset()
    assert seen == ["GPU#x#0", "GPU#x#1", "GPU#x#2", "GPU#x#3", "GPU#x#0", "GPU#x#1"]
    # 4 x 1 KiB input copies + the layers; CPU: x and its 3 slots, 4 copies of h1, the layers
    assert (s.get_buffer_size(gpu), s.get_buffer_size(cpu)) == (4 * 1024 + 2048, 8 * 1024 + 2048)
    s.synchronize()  # not allocated: the next graph starts again at slot 0
    assert s.next_copy == 0
    g, t = mlp(w, 4)
    s.alloc_graph(g)
    assert s.cur_copy == 0 and t["m0"].src[1].name == "GPU#x#0"


def test_parallel_events_replace_synchronize():
    gpu, cpu = mocks("GPU", "CPU", events=True)
    g, t = mlp(mlp_weights([gpu, gpu, cpu, cpu]), 4)
    s = Scheduler([gpu, cpu], parallel=True)
    s.alloc_graph(g)
    clear(gpu, cpu)
    s.graph_compute(g)
    assert logs(gpu, cpu) == {"GPU": "esync compute[m0,a0,h0,m1,a1,h1] record sync sync",
                              "CPU": "wait esync compute[m2,a2,h2,m3,a3,h3] record sync"}

    accel, cpu = mocks("ACCEL", "CPU", events=True)
    w = weights([("B", (64,), cpu)])
    g = graph_of(named(lg.relu(named(lg.add(new_input("x", (64, 4)), w["B"]), "a")), "r"))
    s = Scheduler([accel, cpu], parallel=True)
    s.alloc_graph(g)
    clear(accel, cpu)
    s.graph_compute(g)
    assert logs(accel, cpu) == {"ACCEL": "compute[r] record sync", "CPU": "compute[a] record esync sync"}


# -- allocation: when to re-reserve ------------------------------------------------------------------------------
def test_reserve_only_when_needed():
    gpu, cpu = mocks("GPU", "CPU")
    w = mlp_weights([gpu, gpu, cpu, cpu])
    s = Scheduler([gpu, cpu])
    g, _ = mlp(w, 4)
    clear(gpu, cpu)
    s.alloc_graph(g)  # first time: the ids differ from the zero-filled previous ones -> reserve
    assert logs(gpu, cpu) == {"GPU": "sync", "CPU": "sync"}
    s.reset()
    g, t = mlp(w, 4)
    clear(gpu, cpu)
    s.alloc_graph(g)  # same shape: replayed, no synchronization
    assert logs(gpu, cpu) == {"GPU": "", "CPU": ""}
    assert place(t["m0"]) == ("GPU_buf", 1024)

    s.debug_realloc = 1
    s.reset()
    g, _ = mlp(w, 3)   # a different graph size: an expected re-reservation
    s.alloc_graph(g)
    s.reset()
    g, _ = mlp(w, 3, n_tok=8)  # the same size but larger tensors: unexpected
    with pytest.raises(RuntimeError, match="unexpected graph reallocation"):
        s.alloc_graph(g)


def test_reserve_then_smaller_graphs_fit():
    gpu, cpu = mocks("GPU", "CPU")
    w = mlp_weights([gpu, gpu, cpu, cpu])
    s = Scheduler([gpu, cpu])
    g, _ = mlp(w, 4, n_tok=8)
    assert s.reserve_size(g) == [4096, 4096]
    assert s.get_buffer_size(gpu) == 0  # reserve_size plans only
    assert s.reserve(mlp(w, 4, n_tok=8)[0])
    assert (s.get_buffer_size(gpu), s.get_buffer_size(cpu)) == (4096, 4096)
    g, t = mlp(w, 4, n_tok=4)
    clear(gpu, cpu)
    assert s.alloc_graph(g)
    assert logs(gpu, cpu) == {"GPU": "", "CPU": ""}  # the worst-case plan is replayed
    assert place(t["m1"]) == ("GPU_buf", 0) and place(t["m0"]) == ("GPU_buf", 2048)  # worst-case offsets
    with pytest.raises(ValueError, match="already allocated"):
        s.alloc_graph(g)


# -- eval callback -------------------------------------------------------------------------------------------------
def test_eval_callback_batches_and_stop():
    gpu, cpu = mocks("GPU", "CPU")
    w = mlp_weights([gpu, gpu, cpu, cpu])
    for stop_at, gpu_log in ((None, "sync compute[m0,a0] sync compute[h0,m1,a1,h1] sync sync sync"),
                             ("a0", "sync compute[m0,a0] sync sync sync")):
        calls = []

        def cb(t, ask):
            calls.append((t.name, ask))
            return t.name in ("a0", "m2") if ask else t.name != stop_at

        g, _ = mlp(w, 4)
        s = Scheduler([gpu, cpu])
        s.set_eval_callback(cb)
        s.alloc_graph(g)
        clear(gpu, cpu)
        s.graph_compute(g)
        # stopping ends the split, not the graph
        assert logs(gpu, cpu) == {"GPU": gpu_log,
                                  "CPU": "sync sync compute[m2] sync compute[a2,h2,m3,a3,h3] sync sync"}
        assert calls[:3] == [("m0", True), ("a0", True), ("a0", False)]
        assert ("m2", False) in calls and ("h3", False) not in calls
    s.set_eval_callback(None)
    clear(gpu, cpu)
    s.reset()
    s.graph_compute(mlp(w, 4)[0])
    assert gpu.log.count("compute[m0,a0,h0,m1,a1,h1]") == 1


# -- odds and ends -------------------------------------------------------------------------------------------------
def test_compute_allocates_and_reset_rules():
    gpu, cpu = mocks("GPU", "CPU")
    w = mlp_weights([gpu, gpu, cpu, cpu])
    s = Scheduler([gpu, cpu])
    g, t = mlp(w, 4)
    assert s.graph_compute(g) == Status.SUCCESS  # allocates on its own
    assert t["m0"].buffer is not None
    clear(gpu, cpu)
    assert s.graph_compute(g) == Status.SUCCESS  # still allocated: runs the same splits again
    assert "compute[m0,a0,h0,m1,a1,h1]" in gpu.log


def test_graph_optimize_reorders_the_user_graph():
    gpu, cpu = mocks("GPU", "CPU")
    gpu.graph_optimize = lambda sg: sg.nodes.reverse() if len(sg.nodes) == 2 else None
    w = weights([("A", (64,), gpu), ("B", (64,), gpu)])
    x = new_input("x", (64, 4))
    p = named(lg.add(x, w["A"]), "p")
    q = named(lg.add(x, w["B"]), "q")  # independent of p
    out = named(lg.concat(p, q, 1), "out")
    g = lg.Graph()
    lg.build_forward_expand(g, p)
    lg.build_forward_expand(g, q)
    s = Scheduler([gpu, cpu])
    s.set_tensor_backend(out, cpu)
    lg.build_forward_expand(g, out)
    s.alloc_graph(g)
    assert [n.name for n in g.nodes] == ["q", "p", "out"]
    assert [n.name for n in s.splits[0].graph.nodes] == ["q", "p"]
    assert [n.name for n in s.graph_copy.nodes] == [
        "x (view)", "GPU#x#0", "q", "p", "p (view)", "CPU#p#0", "q (view)", "CPU#q#0", "out"]


def test_to_dot_draws_splits_and_copies(tmp_path):
    gpu, cpu = mocks("GPU", "CPU")
    g, _ = mlp(mlp_weights([gpu, gpu, cpu, cpu]), 4)
    plain = g.to_dot()
    assert plain.startswith("digraph G {") and "cluster" not in plain and "shape=record" in plain
    s = Scheduler([gpu, cpu])
    s.alloc_graph(g)
    text = g.to_dot(str(tmp_path / "g.dot"), sched=s)
    assert (tmp_path / "g.dot").read_text() == text
    assert 'subgraph cluster_0 { label="#0 GPU, inputs: x"' in text
    assert 'subgraph cluster_1 { label="#1 CPU, inputs: h1"' in text
    assert text.count("fillcolor") == len(g.nodes) + len(g.leafs) + 2
    assert re.search(r't\d+ \[shape=ellipse, label="CPU#h1#0", style="filled,dashed"', text)
    assert text.count('[style=dashed, label="copy"]') == 2


# -- real computation: the CPU backend and a second CPU-backed device with its own memory ---------------------------
RNG = np.random.default_rng(0)


def fill_weights(w, values):
    for name, t in w.items():
        lg.tensor_set(t, values[name])


def run_graph(s, build, inputs):
    """Reset, build a fresh graph, allocate, set the inputs, compute; the output as an array."""
    s.reset()
    g, out, tensors = build()
    assert s.alloc_graph(g)
    for name, arr in inputs.items():
        lg.tensor_set(tensors[name], arr)
    assert s.graph_compute(g) == Status.SUCCESS
    return lg.tensor_get(out)[0, 0]


def mlp_case(n_layers=4, n=64, n_tok=4):
    values = {}
    for i in range(n_layers):
        values[f"W{i}"] = RNG.standard_normal((n, n), dtype=np.float32) / 8
        values[f"B{i}"] = RNG.standard_normal(n, dtype=np.float32)
    x = RNG.standard_normal((n_tok, n), dtype=np.float32)
    h = x
    for i in range(n_layers):
        h = np.maximum(h @ values[f"W{i}"].T + values[f"B{i}"], 0)
    return values, x, h


PLACEMENTS = {
    "all_A": lambda a, b: [a] * 4,
    "all_B": lambda a, b: [b] * 4,
    "alternating": lambda a, b: [a, b, a, b],
    "alternating_B_first": lambda a, b: [b, a, b, a],
}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_mlp_matches_cpu_alone(placement):
    values, x, expected = mlp_case()
    cpu = cpu_device().init_backend()
    ref_w = mlp_weights([cpu] * 4)
    fill_weights(ref_w, values)
    ref = run_graph(Scheduler([cpu]), lambda: _mlp_build(ref_w), {"x": x})
    np.testing.assert_allclose(ref, expected, rtol=1e-4, atol=1e-4)

    dev = StandInDevice("DEV").init_backend()
    w = mlp_weights(PLACEMENTS[placement](dev, cpu))
    fill_weights(w, values)
    s = Scheduler([dev, cpu])
    out = run_graph(s, lambda: _mlp_build(w), {"x": x})
    np.testing.assert_array_equal(out, ref)
    assert s.n_splits == {"all_A": 1, "all_B": 1, "alternating": 4, "alternating_B_first": 4}[placement]


def test_mlp_over_three_devices_matches_cpu_alone():
    values, x, expected = mlp_case()
    cpu = cpu_device().init_backend()
    d0, d1 = StandInDevice("DEV0").init_backend(), StandInDevice("DEV1").init_backend()
    w = mlp_weights([d0, d1, cpu, d0])
    fill_weights(w, values)
    s = Scheduler([d0, d1, cpu])
    out = run_graph(s, lambda: _mlp_build(w), {"x": x})
    assert split_list(s)[0][:1] == ("DEV0",) and s.n_splits == 4
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def _mlp_build(w):
    g, t = mlp(w, 4)
    return g, t["h3"], t


# a small transformer block: attention with RoPE and a causal mask, then a SwiGLU feed-forward
N_EMBD, N_HEAD, N_TOK, N_FF = 32, 4, 6, 48
HEAD_DIM = N_EMBD // N_HEAD
BLOCK_WEIGHTS = [("attn_norm", (N_EMBD,)), ("wq", (N_EMBD, N_EMBD)), ("wk", (N_EMBD, N_EMBD)),
                 ("wv", (N_EMBD, N_EMBD)), ("wo", (N_EMBD, N_EMBD)), ("ffn_norm", (N_EMBD,)),
                 ("w_gate_up", (N_EMBD, 2 * N_FF)), ("w_down", (N_FF, N_EMBD))]


def block_build(w):
    ctx = lg.Context()
    with ctx:
        x = named(ctx.new_tensor_2d(lg.F32, N_EMBD, N_TOK), "x")
        pos = named(ctx.new_tensor_1d(lg.I32, N_TOK), "pos")
        mask = named(ctx.new_tensor_2d(lg.F32, N_TOK, N_TOK), "mask")
        for t in (x, pos, mask):
            lg.set_input(t)
        h = lg.mul(lg.rms_norm(x, 1e-5), w["attn_norm"])
        q = lg.reshape_3d(lg.mul_mat(w["wq"], h), HEAD_DIM, N_HEAD, N_TOK)
        k = lg.reshape_3d(lg.mul_mat(w["wk"], h), HEAD_DIM, N_HEAD, N_TOK)
        v = lg.reshape_3d(lg.mul_mat(w["wv"], h), HEAD_DIM, N_HEAD, N_TOK)
        q = lg.permute(lg.rope_ext(q, pos, None, HEAD_DIM, lg.ROPE_TYPE_NEOX), 0, 2, 1, 3)
        k = lg.permute(lg.rope_ext(k, pos, None, HEAD_DIM, lg.ROPE_TYPE_NEOX), 0, 2, 1, 3)
        kq = lg.soft_max_ext(lg.mul_mat(k, q), mask, 1.0 / np.sqrt(HEAD_DIM))
        vt = lg.cont(lg.permute(v, 1, 2, 0, 3))  # [n_tok, head_dim, n_head]
        kqv = lg.permute(lg.mul_mat(vt, kq), 0, 2, 1, 3)  # [head_dim, n_head, n_tok]
        attn = lg.mul_mat(w["wo"], lg.reshape_2d(lg.cont(kqv), N_EMBD, N_TOK))
        h2 = lg.add(x, attn)
        f = lg.mul(lg.rms_norm(h2, 1e-5), w["ffn_norm"])
        out = named(lg.add(h2, lg.mul_mat(w["w_down"], lg.swiglu(lg.mul_mat(w["w_gate_up"], f)))), "out")
    lg.set_output(out)
    return graph_of(out), out, {"x": x, "pos": pos, "mask": mask}


def block_case():
    values = {}
    for name, ne in BLOCK_WEIGHTS:
        shape = tuple(reversed(ne))
        values[name] = (1 + RNG.standard_normal(shape, dtype=np.float32) / 4 if len(ne) == 1
                        else RNG.standard_normal(shape, dtype=np.float32) / np.sqrt(ne[0]).astype(np.float32))
    mask = np.triu(np.full((N_TOK, N_TOK), -np.inf, dtype=np.float32), 1)
    inputs = {"x": RNG.standard_normal((N_TOK, N_EMBD), dtype=np.float32),
              "pos": np.arange(N_TOK, dtype=np.int32), "mask": mask}
    return values, inputs


BLOCK_PLACEMENTS = {
    "all_A": lambda a, b: [a] * len(BLOCK_WEIGHTS),
    "all_B": lambda a, b: [b] * len(BLOCK_WEIGHTS),
    "alternating": lambda a, b: [(a, b)[i % 2] for i in range(len(BLOCK_WEIGHTS))],
    "alternating_B_first": lambda a, b: [(b, a)[i % 2] for i in range(len(BLOCK_WEIGHTS))],
}


@pytest.mark.parametrize("placement", list(BLOCK_PLACEMENTS))
def test_transformer_block_matches_cpu_alone(placement):
    values, inputs = block_case()
    cpu = cpu_device().init_backend()
    ref_w = weights([(n, ne, cpu) for n, ne in BLOCK_WEIGHTS])
    fill_weights(ref_w, values)
    ref = run_graph(Scheduler([cpu]), lambda: block_build(ref_w), inputs)
    assert np.isfinite(ref).all()

    dev = StandInDevice("DEV").init_backend()
    where_ = BLOCK_PLACEMENTS[placement](dev, cpu)
    w = weights([(n, ne, b) for (n, ne), b in zip(BLOCK_WEIGHTS, where_)])
    fill_weights(w, values)
    s = Scheduler([dev, cpu])
    out = run_graph(s, lambda: block_build(w), inputs)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    if placement.startswith("alternating"):
        assert s.n_splits > 4


def test_parallel_never_returns_stale_data():
    cpu = cpu_device().init_backend()
    dev = StandInDevice("DEV", deferred=True).init_backend()
    values, _, _ = mlp_case()
    w = mlp_weights([dev, cpu, dev, cpu])
    fill_weights(w, values)
    s = Scheduler([dev, cpu], parallel=True)
    slots = set()
    for i in range(100):
        x = RNG.standard_normal((4, 64), dtype=np.float32)
        h = x
        for k in range(4):
            h = np.maximum(h @ values[f"W{k}"].T + values[f"B{k}"], 0)
        out = run_graph(s, lambda: _mlp_build(w), {"x": x})
        slots.add(s.cur_copy)
        np.testing.assert_allclose(out, h, rtol=1e-4, atol=1e-4, err_msg=f"compute #{i}")
    assert slots == {0, 1, 2, 3}


# -- a host buffer that is not a HostBuffer ----------------------------------------------------------------------
class BytesBuffer(Buffer):
    """Host memory kept its own way, in a ``bytearray`` (no ``.data``): its type says ``is_host``, but
    only its own ``get_tensor`` and ``set_tensor`` reach it."""

    def __init__(self, buft, size):
        super().__init__(buft, size)
        self.mem = bytearray(size)

    def set_tensor(self, t, data, offset, size):
        start = t.offset + offset
        self.mem[start:start + size] = data[:size].tobytes()

    def get_tensor(self, t, offset, size):
        return np.frombuffer(self.mem, np.uint8, size, t.offset + offset).copy()


class BytesBufferType(BufferType):
    def __init__(self):
        super().__init__("BYTES", alignment=32, host=True)

    def alloc_buffer(self, size):
        return BytesBuffer(self, size)


def _tensors_in(buft, *names, ne=(64, 4)):
    ctx = lg.Context()
    ts = [named(ctx.new_tensor(lg.F32, ne), n) for n in names]
    alloc_ctx_tensors_from_buft(ctx, buft)
    return ts


def test_tensor_copy_reaches_a_host_buffer_that_is_no_host_buffer_through_its_get_and_set():
    """A round trip BYTES -> CPU (a HostBuffer) -> BYTES -> a device's memory -> BYTES keeps the bytes."""
    x = RNG.standard_normal((4, 64), dtype=np.float32)
    a, c, e = _tensors_in(BytesBufferType(), "a", "c", "e")
    b, = _tensors_in(cpu_device().get_buffer_type(), "b")
    d, = _tensors_in(StandInDevice("DEV").get_buffer_type(), "d")
    lg.tensor_set(a, x)
    for src, dst in ((a, b), (b, c), (c, d), (d, e)):
        lg.tensor_copy(src, dst)
        np.testing.assert_array_equal(lg.tensor_get(dst)[0, 0], x, err_msg=f"{src.name} -> {dst.name}")


@pytest.mark.parametrize("snapshots", [False, True])
def test_a_graph_takes_its_inputs_from_a_host_buffer_that_is_no_host_buffer(snapshots):
    """relu(W x + s) on a device, W its weight; x (an input) and s in BYTES memory, which only the CPU
    accepts: both are split inputs, copied through BYTES' get_tensor (by tensor_copy, or, on a backend
    whose uploads snapshot host memory, by its set_tensor_async)."""
    dev = StandInDevice("DEV").init_backend()
    if snapshots:
        dev.host_copy_snapshots = True
        dev.set_tensor_async = lambda t, data, offset, size: t.data_buffer().set_tensor(t, data, offset, size)
    cpu = cpu_device().init_backend()
    values, x, _ = mlp_case(n_layers=1)
    w = mlp_weights([dev], n=64)
    fill_weights(w, values)
    x_t, s_t = _tensors_in(BytesBufferType(), "x", "s")
    lg.set_input(x_t)
    s_val = RNG.standard_normal((4, 64), dtype=np.float32)
    lg.tensor_set(x_t, x)
    lg.tensor_set(s_t, s_val)
    out = lg.relu(lg.add(lg.mul_mat(w["W0"], x_t), s_t))
    lg.set_output(out)
    g = graph_of(out)
    s = Scheduler([dev, cpu])
    assert s.alloc_graph(g) and s.graph_compute(g) == Status.SUCCESS
    assert [(name, sorted(inputs)) for name, _, _, inputs in split_list(s)] == [("DEV", ["s", "x"])]
    np.testing.assert_allclose(lg.tensor_get(out)[0, 0], np.maximum(x @ values["W0"].T + s_val, 0), rtol=1e-5,
                               atol=1e-5)


def test_the_cpu_refuses_to_compute_in_place_on_a_host_buffer_that_is_no_host_buffer():
    """Its weights draw the op to the CPU, which computes on host memory in place: a clear error naming
    the buffer's class, not an AttributeError deep in a kernel plan."""
    w, = _tensors_in(BytesBufferType(), "w", ne=(64, 64))
    w.buffer.usage = BufferUsage.WEIGHTS
    x = new_input("x", (64, 4))
    out = lg.mul_mat(w, x)
    g = graph_of(out)
    s = Scheduler([cpu_device().init_backend()])
    assert s.alloc_graph(g)
    lg.tensor_set(x, RNG.standard_normal((4, 64), dtype=np.float32))
    with pytest.raises(lg.AllocationError, match=r"'w' is in a BytesBuffer of type BYTES, which says is_host"):
        s.graph_compute(g)
