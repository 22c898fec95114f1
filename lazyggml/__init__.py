"""lazyggml: a GGML-compatible lazy tensor runtime for Python, with kernels compiled by Numba.

The low-level API mirrors ``ggml.h``, ``ggml-alloc.h`` and ``ggml-backend.h``: the same names in
snake_case without the ``ggml_`` prefix, the same argument order and semantics.

    import numpy as np, lazyggml as lg
    ctx = lg.Context(no_alloc=False)          # tensors get host memory as they are made
    a = ctx.new_tensor_2d(lg.F32, 4, 3)       # ne = [4, 3]: NumPy shape (3, 4)
    b = lg.relu(lg.scale(a, 2.0))             # lazy: nothing computed yet
    g = lg.Graph(); lg.build_forward_expand(g, b)
    lg.tensor_set(a, np.ones((3, 4), np.float32))
    lg.backend_graph_compute(lg.backend_cpu_init(), g)
    lg.tensor_get(b)                          # a 4-D array, shape reversed(ne)

Errors lazyggml raises for bad input are ``lg.LazyGGMLError``s (``errors.py``).
"""
from . import cache  # first: points Numba's kernel cache at lazyggml's directory before Numba loads
from .errors import (LazyGGMLError, GGUFError, ShapeError, TensorTypeError, UnsupportedOpError, ChatTemplateError,
                     AllocationError, OutOfMemoryError)
from .types import Type, QK_K, blck_size, type_size, row_size, is_quantized, type_name
from .tensor import (Tensor, Context, MAX_DIMS, MAX_SRC, FLAG_INPUT, FLAG_OUTPUT, FLAG_PARAM, FLAG_LOSS,
                     FLAG_COMPUTE, set_input, set_output, set_param, set_loss, set_name, get_name)
from .ops import *  # noqa: F401,F403 - every op constructor, named as GGML's
from .ops import Op, UnaryOp, GluOp, ROPE_TYPE_NORMAL, ROPE_TYPE_NEOX, op_desc, is_view_op, op_can_inplace
from .graph import Graph, build_forward_expand, build_forward_select, graph_view
from .buffer import (BufferType, Buffer, HostBuffer, MultiBuffer, BufferUsage, Status, tensor_alloc, view_init,
                     buft_alloc_buffer)
from .backend import (Device, Backend, Registry, DeviceType, tensor_set, tensor_get, tensor_get_bytes,
                      tensor_memset, tensor_copy, tensor_copy_async, tensor_set_async, backend_graph_compute,
                      event_new, event_synchronize)
from .registry import (register_backend, reg_count, reg_get, reg_by_name, dev_count, dev_get, dev_by_name,
                       dev_by_type, backend_init_by_name, backend_init_by_type, backend_init_best, rpc_add_server,
                       rpc_device)
from .backends.cpu import set_n_threads, backend_cpu_init
from .quants import quantize, dequantize
from .alloc import (Gallocr, Tallocr, DynTallocr, alloc_ctx_tensors, alloc_ctx_tensors_from_buft,
                    alloc_ctx_tensors_from_buft_size)
from .sched import Scheduler
from .gguf_io import GGUFFile, TensorInfo, read_gguf
from .models.hparams import HParams, check_tensors
from .tokenizer import Tokenizer
from .sampling import Sampler
from . import testing
from .models.batch import Batch
from .models.runner import load_model

# every tensor type under its GGML name, as ggml.h's GGML_TYPE_*: lg.F32, lg.Q4_K, ... (types.Type)
globals().update(Type.__members__)

__version__ = "0.1.0"
