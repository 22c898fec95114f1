#!/usr/bin/env python3
"""Train, quantize and export lazyggml's embedded default model (``lazyggml/data/default.gguf``).

What it makes
-------------
A small LLaMA-architecture language model trained on the King James Version of the Bible (public
domain; see ``lazyggml/data/NOTICE``), exported as a llama.cpp-compatible GGUF with the Q4_K_M type
mix, plus ``lazyggml/data/default.json`` with the figures lazyggml's own runner must reproduce.

Steps (all deterministic, fixed seed):

1. **Corpus** (``--rebuild-corpus`` only): the text comes from Debian's ``bible-kjv-text`` package,
   printed with its ``bible`` program (``apt-get install bible-kjv``) as
   ``bible -l0 gen1:1-rev22:21``; verse numbers are dropped, each chapter becomes a heading line
   (``"Genesis 1"``), one line per verse, and a blank line. The chapters are cut at the first
   chapter boundary past 95% of the characters: before it ``kjv-train.txt.gz``, from it on
   ``kjv-eval.txt.gz`` (held out: never trained on). Without the flag the shipped files are used.
2. **Tokenizer**: a SentencePiece-style ("llama") vocabulary with byte fallback: ``<unk>``, ``<s>``,
   ``</s>``, the 256 byte tokens ``<0x00>``..``<0xFF>``, then BPE pieces learnt on the training text
   with ``lazyggml.testing._train_bpe`` (scores = -merge rank, single characters below every merge,
   as SentencePiece's BPE models score them). The words BPE learns on are the ones the SPM tokenizer
   sees: a space becomes "▁" and belongs to the following word, a newline is a byte of its own.
   Every text is tokenized with ``lazyggml.tokenizer.Tokenizer`` built from the very metadata that
   goes into the GGUF, so training, evaluation and the runner share one tokenization.
3. **Model** (PyTorch, CPU, float32): llama.cpp's ``llama`` graph exactly: token embedding, per layer
   RMSNorm -> Q/K/V (GQA) -> RoPE -> causal softmax attention (scale 1/sqrt(head_dim)) -> output
   projection, residual, RMSNorm -> SwiGLU FFN (down(silu(gate(x)) * up(x))), residual; final RMSNorm
   and an untied output projection. **RoPE is GGML's "normal" mode (rope type 0) written directly**:
   it rotates adjacent pairs (x[2i], x[2i+1]) by pos * base^(-2i/head_dim), so the Q/K rows are
   exported as they are (no HF-style permutation; the HF converter's permutation exists only to turn
   HF's rotate-half layout into this one).
4. **Training**: AdamW, linear warm-up then cosine decay, random windows of ``n_ctx`` tokens from the
   training split each starting with BOS (the same framing as the evaluation), for a wall-clock budget
   (``--minutes``) or ``--steps``.
5. **Export**: every 2-D weight quantized with ``lazyggml.quants.quantize`` (bit-exact with GGML) to
   the type llama-quantize gives it in a Q4_K_M file (``lazyggml.testing.q4_k_m_type``: Q4_K; Q6_K
   for ``output`` and for ``attn_v``/``ffn_down`` in ``use_more_bits`` layers), norms F32; GGML shapes
   ne=[in, out], i.e. PyTorch's ``Linear.weight`` (out, in) as it is.
6. **Figures**: the held-out perplexity of the float weights and of the *dequantized exported*
   weights (read back from the GGUF, ``lazyggml.quants.dequantize``, loaded into the PyTorch model),
   and three greedy samples from the quantized weights.

Perplexity protocol (what ``default.json`` stores and what lazyggml must reproduce)
----------------------------------------------------------------------------------
``text = gzip.open("lazyggml/data/kjv-eval.txt.gz").read().decode("utf-8")``;
``ids = Tokenizer(metadata).tokenize(text, add_special=False)`` (SPM: one space prefix in front of
the whole text, no BOS); cut ``ids`` into consecutive non-overlapping chunks of ``n_ctx - 1 = 255``
tokens (the last chunk may be shorter); each window is ``[BOS] + chunk``, evaluated from an empty
KV cache; every chunk token is predicted from the logits at the position before it (the BOS
position predicts the first chunk token), so a window of 1 + m tokens gives m predictions. NLL is
``-log_softmax(logits)[target]`` in float64; perplexity = ``exp(sum NLL / number of predictions)``
over all windows. ``default.json`` also holds the same figure for only the first 8 windows
(a quick check).

How to run
----------
::

    python3 -m venv /work/trainvenv
    /work/trainvenv/bin/pip install torch==2.13.0 numpy gguf numba llvmlite regex
    PYTHONPATH=. /work/trainvenv/bin/python scripts/train_default_model.py            # ~24 min
    PYTHONPATH=. /work/trainvenv/bin/python scripts/train_default_model.py --minutes 1 --out /tmp/x

On the project's 2-core machine (shared with other work, so times vary by 2-3x): 2-3.5 minutes for
the vocabulary (BPE training is pure Python) and tokenization, the training budget (``--minutes``,
default 18: the shipped model did 346 steps of 8 x 256 tokens in it), then 2-3 minutes for the
export and evaluation; about 24 minutes in all. The float checkpoint goes to ``--ckpt``;
``--from-ckpt`` re-exports from it without training. Results are reproducible up to the wall-clock
budget: with ``--steps N`` they are fully deterministic on one machine (same torch version, same
thread count); the step count of the shipped model is in ``default.json`` (``training.steps``),
though the learning-rate schedule of a budgeted run follows the clock, not the step.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lazyggml import quants  # noqa: E402
from lazyggml.gguf_io import read_gguf  # noqa: E402
from lazyggml.models.hparams import HParams, check_tensors  # noqa: E402
from lazyggml.testing import LLAMA_FTYPE_MOSTLY_Q4_K_M, _byte_values, _pad_unused, _train_bpe, q4_k_m_type
from lazyggml.tokenizer import SPIECE_UNDERLINE, Tokenizer, TokenType  # noqa: E402
from lazyggml.types import Type  # noqa: E402

DATA = ROOT / "lazyggml" / "data"
TRAIN_FILE = "kjv-train.txt.gz"
EVAL_FILE = "kjv-eval.txt.gz"
EVAL_FRACTION = 0.05
N_QUICK_WINDOWS = 8

CONFIG = dict(
    n_vocab=1024, n_ctx=256, n_embd=256, n_layer=4, n_head=4, n_head_kv=2, n_ff=768,
    rms_eps=1e-5, rope_freq_base=10000.0,
)
SAMPLE_PROMPTS = ["In the beginning God", "And the LORD said unto Moses,", "Blessed are the"]


# --- 1. corpus --------------------------------------------------------------------------------------

def build_corpus() -> str:
    """The KJV text from Debian's ``bible`` program, one heading line per chapter, one line per
    verse (numbers dropped), a blank line after each chapter."""
    raw = subprocess.run(["bible", "-l0", "gen1:1-rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    chapters, cur = [], None
    for line in raw.split("\n"):
        m = re.match(r"^  \d+ (.*)$", line)
        if m:
            cur.append(m.group(1).strip())
        elif line.strip():
            cur = [line.strip()]
            chapters.append(cur)
    n_verses = sum(len(c) - 1 for c in chapters)
    if len(chapters) != 1189 or n_verses != 31102:
        raise SystemExit(f"unexpected bible output: {len(chapters)} chapters, {n_verses} verses")
    return ["\n".join(c) + "\n\n" for c in chapters]


def write_corpus():
    chapters = build_corpus()
    total = sum(len(c) for c in chapters)
    acc, cut = 0, len(chapters)
    for i, c in enumerate(chapters):
        if acc >= (1 - EVAL_FRACTION) * total:
            cut = i
            break
        acc += len(c)
    for name, part in ((TRAIN_FILE, chapters[:cut]), (EVAL_FILE, chapters[cut:])):
        # mtime=0 and no file name in the header: the same text gives the same bytes
        with open(DATA / name, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f,
                                                          compresslevel=9, mtime=0) as g:
            g.write("".join(part).encode("utf-8"))
    print(f"corpus: {cut} training chapters, {len(chapters) - cut} held out "
          f"(from '{chapters[cut].splitlines()[0]}')")


def load_text(name: str) -> str:
    with gzip.open(DATA / name, "rb") as f:
        return f.read().decode("utf-8")


# --- 2. tokenizer -----------------------------------------------------------------------------------

def spm_words(text: str) -> Counter:
    """The words an SPM tokenizer sees in ``text`` (with add_space_prefix): spaces become "▁" and
    start a word, newlines (byte tokens, never inside a piece) separate words."""
    words = Counter()
    for line_no, line in enumerate(text.split("\n")):
        if line_no == 0:
            line = " " + line
        for k, w in enumerate(line.split(" ")):
            if k > 0:
                w = SPIECE_UNDERLINE + w
            if w:
                words[tuple(w)] += 1
    return words


def build_vocab(text: str, n_vocab: int):
    """tokens, scores, token types of an SPM vocabulary learnt on ``text``."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    byte_values = _byte_values(n_vocab - len(tokens))
    tokens += [f"<0x{b:02X}>" for b in byte_values]
    types += [TokenType.BYTE] * len(byte_values)
    words = spm_words(text)
    freq = Counter()
    for w, n in words.items():
        for c in w:
            freq[c] += n
    chars = sorted(freq, key=lambda c: (-freq[c], c))  # all characters of the text (ASCII here)
    n_merges = n_vocab - len(tokens) - len(chars)
    merges = _train_bpe(words, set(chars), n_merges)
    pieces = list(dict.fromkeys(a + b for a, b in merges))
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    scores += [-float(len(pieces) + i) for i in range(len(chars))]
    tokens += pieces + chars
    types += [TokenType.NORMAL] * (len(pieces) + len(chars))
    _pad_unused(tokens, types, scores, n_vocab)
    return tokens, scores, types


def vocab_metadata(tokens, scores, types) -> dict:
    """The tokenizer.ggml.* keys as read_gguf returns them (and as they are written)."""
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": list(tokens),
        "tokenizer.ggml.scores": [float(s) for s in scores],
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
    }


def eval_windows(ids, bos: int, n_ctx: int) -> list:
    """The perplexity protocol's windows: [BOS] + consecutive chunks of n_ctx - 1 tokens."""
    step = n_ctx - 1
    return [[bos] + list(ids[i:i + step]) for i in range(0, len(ids), step)]


# --- 3. model ---------------------------------------------------------------------------------------

def make_model_classes():
    """The PyTorch modules (imported lazily: only the training venv has torch)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, n, eps):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def rope_tables(n_ctx, head_dim, base):
        """cos, sin of GGML's normal RoPE: pair i of a head turns by pos * base^(-2i/head_dim)."""
        inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        ang = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv[None, :]
        return torch.cos(ang).float(), torch.sin(ang).float()

    def rope_normal(x, cos, sin):
        """x: (B, H, T, D). Rotate the adjacent pairs (x[2i], x[2i+1]) (GGML rope mode 0)."""
        x0, x1 = x[..., 0::2], x[..., 1::2]
        y0 = x0 * cos - x1 * sin
        y1 = x0 * sin + x1 * cos
        return torch.stack((y0, y1), dim=-1).flatten(-2)

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            d, hd = c["n_embd"], c["n_embd"] // c["n_head"]
            self.n_head, self.n_head_kv, self.hd = c["n_head"], c["n_head_kv"], hd
            self.attn_norm = RMSNorm(d, c["rms_eps"])
            self.attn_q = nn.Linear(d, c["n_head"] * hd, bias=False)
            self.attn_k = nn.Linear(d, c["n_head_kv"] * hd, bias=False)
            self.attn_v = nn.Linear(d, c["n_head_kv"] * hd, bias=False)
            self.attn_output = nn.Linear(c["n_head"] * hd, d, bias=False)
            self.ffn_norm = RMSNorm(d, c["rms_eps"])
            self.ffn_gate = nn.Linear(d, c["n_ff"], bias=False)
            self.ffn_up = nn.Linear(d, c["n_ff"], bias=False)
            self.ffn_down = nn.Linear(c["n_ff"], d, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            h = self.attn_norm(x)
            q = self.attn_q(h).view(B, T, self.n_head, self.hd).transpose(1, 2)
            k = self.attn_k(h).view(B, T, self.n_head_kv, self.hd).transpose(1, 2)
            v = self.attn_v(h).view(B, T, self.n_head_kv, self.hd).transpose(1, 2)
            q, k = rope_normal(q, cos[:T], sin[:T]), rope_normal(k, cos[:T], sin[:T])
            # GQA as GGML broadcasts it: query head j reads KV head j // (n_head / n_head_kv)
            r = self.n_head // self.n_head_kv
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_output(a.transpose(1, 2).reshape(B, T, -1))
            h = self.ffn_norm(x)
            return x + self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))

    class Llama(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c = c
            self.token_embd = nn.Embedding(c["n_vocab"], c["n_embd"])
            self.blk = nn.ModuleList(Block(c) for _ in range(c["n_layer"]))
            self.output_norm = RMSNorm(c["n_embd"], c["rms_eps"])
            self.output = nn.Linear(c["n_embd"], c["n_vocab"], bias=False)
            cos, sin = rope_tables(c["n_ctx"], c["n_embd"] // c["n_head"], c["rope_freq_base"])
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02
                    if name.endswith(("attn_output.weight", "ffn_down.weight")):
                        std = 0.02 / math.sqrt(2 * c["n_layer"])
                    nn.init.normal_(p, 0.0, std)

        def forward(self, idx):
            x = self.token_embd(idx)
            for b in self.blk:
                x = b(x, self.cos, self.sin)
            return self.output(self.output_norm(x))

    return Llama


# --- 4. training ------------------------------------------------------------------------------------

def lr_at(frac: float, peak: float, warmup_frac: float = 0.03, floor: float = 0.1) -> float:
    """Linear warm-up over the first ``warmup_frac`` of training, then cosine decay to
    ``floor * peak``; ``frac`` is the fraction of training done (by step, or by wall clock)."""
    if frac < warmup_frac:
        return peak * (frac / warmup_frac)
    p = min(1.0, (frac - warmup_frac) / (1 - warmup_frac))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def train(model, ids: np.ndarray, c: dict, args, bos: int) -> dict:
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(args.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    T = c["n_ctx"]
    budget = args.minutes * 60.0
    t0 = time.time()
    step, ema = 0, None
    model.train()
    while True:
        elapsed = time.time() - t0
        frac = step / args.steps if args.steps else elapsed / budget
        if frac >= 1.0:
            break
        lr = lr_at(frac, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        # [BOS] + T-1 tokens in, the next T tokens out: the evaluation's framing
        starts = rng.integers(0, len(ids) - T, size=args.batch)
        chunk = np.stack([ids[s:s + T] for s in starts]).astype(np.int64)
        y = torch.from_numpy(chunk)
        x = torch.cat([torch.full((args.batch, 1), bos, dtype=torch.int64), y[:, :-1]], dim=1)
        loss = F.cross_entropy(model(x).reshape(-1, c["n_vocab"]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 20 == 0 or step == 1:
            print(f"step {step:5d}  {elapsed:7.1f} s  lr {lr:.2e}  loss {loss.item():.3f}  "
                  f"(ema {ema:.3f})", flush=True)
    model.eval()
    return {"steps": step, "seconds": round(time.time() - t0, 1), "final_loss_ema": round(ema, 4),
            "tokens_seen": step * args.batch * T}


# --- 5. export --------------------------------------------------------------------------------------

def torch_tensors(model, c: dict) -> dict:
    """GGUF tensor name -> float32 NumPy array in NumPy order (= PyTorch's (out, in) layout, which
    is GGML's ne = [in, out])."""
    sd = {k: v.detach().cpu().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["token_embd.weight"], "output_norm.weight": sd["output_norm.weight"],
           "output.weight": sd["output.weight"]}
    for i in range(c["n_layer"]):
        for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
                     "ffn_up", "ffn_down"):
            out[f"blk.{i}.{part}.weight"] = sd[f"blk.{i}.{part}.weight"]
    return out


def export_gguf(path: Path, model, c: dict, vocab_meta: dict) -> dict:
    """Write the Q4_K_M GGUF; returns tensor name -> type name."""
    from lazyggml.testing import _tensor_shapes
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("lazyggml-default")
    w.add_description("A small LLaMA-architecture model trained by lazyggml's "
                      "scripts/train_default_model.py on the King James Version of the Bible "
                      "(public domain text, from Debian's bible-kjv-text package); "
                      "lazyggml's embedded default model.")
    w.add_license("MIT (weights); training text: public domain")
    w.add_context_length(c["n_ctx"])
    w.add_embedding_length(c["n_embd"])
    w.add_block_count(c["n_layer"])
    w.add_feed_forward_length(c["n_ff"])
    w.add_head_count(c["n_head"])
    w.add_head_count_kv(c["n_head_kv"])
    w.add_rope_dimension_count(c["n_embd"] // c["n_head"])
    w.add_rope_freq_base(c["rope_freq_base"])
    w.add_layer_norm_rms_eps(c["rms_eps"])
    w.add_vocab_size(c["n_vocab"])
    w.add_file_type(LLAMA_FTYPE_MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    m = vocab_meta
    w.add_tokenizer_model(m["tokenizer.ggml.model"])
    w.add_token_list(m["tokenizer.ggml.tokens"])
    w.add_token_scores(m["tokenizer.ggml.scores"])
    w.add_token_types(m["tokenizer.ggml.token_type"])
    w.add_unk_token_id(m["tokenizer.ggml.unknown_token_id"])
    w.add_bos_token_id(m["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(m["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(m["tokenizer.ggml.add_bos_token"])
    w.add_add_eos_token(m["tokenizer.ggml.add_eos_token"])
    w.add_add_space_prefix(m["tokenizer.ggml.add_space_prefix"])

    arrays = torch_tensors(model, c)
    types = {}
    shapes = _tensor_shapes(c["n_layer"], c["n_embd"], c["n_head"], c["n_head_kv"], c["n_ff"],
                            c["n_vocab"], False)
    for name, ne in shapes.items():
        x = np.ascontiguousarray(arrays[name], dtype=np.float32)
        assert x.shape == tuple(reversed(ne)), (name, x.shape, ne)
        t = q4_k_m_type(name, ne, c["n_layer"])
        data = quants.quantize(t, x.reshape(-1, ne[0]))
        w.add_tensor(name, data.reshape(x.shape[:-1] + (data.shape[-1],)),
                     raw_dtype=gguf.GGMLQuantizationType(t))
        types[name] = Type(t).name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


def load_dequantized(model, path: Path, c: dict):
    """Read the GGUF back with lazyggml, dequantize every tensor, load it into ``model``."""
    import torch
    gf = read_gguf(path)
    hp = HParams.from_metadata(gf.metadata, path)
    infos = check_tensors(hp, gf.tensors, path)
    sd = {}
    for name, info in infos.items():
        x = quants.dequantize(info.type, gf.tensor_data(name), info.ne[0])
        sd[name] = torch.from_numpy(x.reshape(tuple(reversed(info.ne))).copy())
    model.load_state_dict({k: sd[k] for k in model.state_dict()})  # module names = GGUF names
    return gf


# --- 6. figures -------------------------------------------------------------------------------------

def perplexity(model, windows: list, batch: int = 16) -> dict:
    """The protocol of the module docstring, on PyTorch: NLL in float64 over every predicted token."""
    import torch
    total, count, per_window = 0.0, 0, []
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            group = windows[i:i + batch]
            for L in sorted({len(w) for w in group}):  # only the last window can be shorter
                ws = [w for w in group if len(w) == L]
                x = torch.tensor(ws, dtype=torch.int64)
                logp = torch.log_softmax(model(x).double(), dim=-1)
                nll = -logp[:, :-1].gather(-1, x[:, 1:, None])[..., 0]
                for row in nll:
                    per_window.append((float(row.sum()), int(row.numel())))
                total += float(nll.sum())
                count += int(nll.numel())
    quick = per_window[:N_QUICK_WINDOWS]
    return {"ppl": math.exp(total / count), "n_predictions": count, "n_windows": len(windows),
            "ppl_first_windows": math.exp(sum(s for s, _ in quick) / sum(n for _, n in quick))}


def greedy(model, tok: Tokenizer, prompt: str, n: int, n_ctx: int) -> dict:
    import torch
    ids = tok.tokenize(prompt, add_special=True)
    n_prompt = len(ids)
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([ids[-n_ctx:]], dtype=torch.int64)
            nxt = int(model(x)[0, -1].argmax())
            ids.append(nxt)
            if tok.is_eog(nxt):
                break
    # without BOS the detokenizer drops the space prefix of the first piece: the text as written
    full = tok.detokenize(ids[1:] if ids[0] == tok.bos_id else ids)
    return {"prompt": prompt, "n_predict": n, "token_ids": ids, "generated_ids": ids[n_prompt:],
            "text": full[len(prompt):] if full.startswith(prompt) else tok.detokenize(ids[n_prompt:]),
            "full_text": full}


# --- main -------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rebuild-corpus", action="store_true",
                    help="regenerate the corpus files from Debian's `bible` program first")
    ap.add_argument("--minutes", type=float, default=18.0, help="training wall-clock budget")
    ap.add_argument("--steps", type=int, default=0, help="train for this many steps instead")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-predict", type=int, default=48, help="tokens per sample")
    ap.add_argument("--out", type=Path, default=DATA, help="where default.gguf/.json go")
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/lazyggml-default-float.pt"),
                    help="float checkpoint written after training (not shipped)")
    ap.add_argument("--from-ckpt", action="store_true",
                    help="skip training: load --ckpt (and its training record) and only export")
    args = ap.parse_args(argv)

    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.rebuild_corpus:
        write_corpus()
    c = dict(CONFIG)
    train_text, eval_text = load_text(TRAIN_FILE), load_text(EVAL_FILE)

    t = time.time()
    saved = torch.load(args.ckpt) if args.from_ckpt else None
    if saved is not None:
        tokens, scores, types = saved["vocab"]
    else:
        tokens, scores, types = build_vocab(train_text, c["n_vocab"])
    vmeta = vocab_metadata(tokens, scores, types)
    tok = Tokenizer(vmeta)
    train_ids = np.array(tok.tokenize(train_text, add_special=False), dtype=np.int32)
    eval_ids = tok.tokenize(eval_text, add_special=False)
    assert tok.detokenize(eval_ids) == eval_text
    windows = eval_windows(eval_ids, tok.bos_id, c["n_ctx"])
    prep_s = round(time.time() - t, 1)
    print(f"vocabulary and tokenization: {prep_s:.0f} s; {len(train_ids)} training tokens, "
          f"{len(eval_ids)} held-out tokens in {len(windows)} windows", flush=True)

    Llama = make_model_classes()
    model = Llama(c)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters, {c}", flush=True)
    if saved is not None:
        model.load_state_dict(saved["model"])
        record = saved["record"]
    else:
        record = train(model, train_ids, c, args, tok.bos_id)
        record.update(prep_s=prep_s, batch=args.batch, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                      threads=args.threads, minutes_budget=None if args.steps else args.minutes,
                      steps_requested=args.steps or None)
        torch.save({"model": model.state_dict(), "record": record,
                    "vocab": (tokens, scores, [int(x) for x in types])}, args.ckpt)
    model.eval()

    t_export = time.time()
    t = time.time()
    float_ppl = perplexity(model, windows)
    print(f"float perplexity: {float_ppl}  ({time.time() - t:.0f} s)", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    gguf_path = args.out / "default.gguf"
    tensor_types = export_gguf(gguf_path, model, c, vmeta)
    gf = load_dequantized(model, gguf_path, c)
    # the file's own vocabulary must tokenize exactly as the one trained with
    ftok = Tokenizer(gf.metadata, gguf_path)
    assert ftok.tokenize(eval_text, add_special=False) == eval_ids
    q_ppl = perplexity(model, windows)
    print(f"quantized perplexity: {q_ppl}", flush=True)
    samples = [greedy(model, ftok, p, args.n_predict, c["n_ctx"]) for p in SAMPLE_PROMPTS]
    for s in samples:
        print(f"--- {s['prompt']!r}\n{s['full_text']}", flush=True)

    size = gguf_path.stat().st_size
    counts = Counter(tensor_types.values())
    figures = {
        "model": "default.gguf",
        "general.name": "lazyggml-default",
        "script": "scripts/train_default_model.py",
        "text": {
            "name": "King James Version of the Bible (1611/1769 text)",
            "train_file": TRAIN_FILE, "eval_file": EVAL_FILE,
            "eval_split": "the last ~5% of the characters, cut at a chapter boundary: "
                          + eval_text.splitlines()[0] + " to Revelation 22",
            "train_chars": len(train_text), "eval_chars": len(eval_text),
            "train_tokens": int(len(train_ids)), "eval_tokens": len(eval_ids),
        },
        "config": c,
        "n_params": n_params,
        "seed": args.seed,
        "training": record,
        "training_time_s": record["seconds"],
        "tensor_types": dict(sorted(counts.items())),
        "file_size_bytes": size,
        "perplexity_protocol": (
            "text = gzip.open('lazyggml/data/kjv-eval.txt.gz').read().decode('utf-8'); "
            "ids = Tokenizer(gguf metadata).tokenize(text, add_special=False) (SPM: one space prefix in "
            "front of the whole text, no BOS); cut ids into consecutive non-overlapping chunks of "
            "n_ctx - 1 = 255 tokens (the last one shorter); window = [BOS] + chunk, each evaluated from "
            "an empty KV cache (model.reset() then model.eval(window, logits_all=True)); the logits at "
            "window position j predict window[j + 1] (BOS predicts the first chunk token), so a window "
            "of 1 + m tokens gives m predictions; NLL = -log_softmax(logits, float64)[target]; "
            "perplexity = exp(sum of NLL / number of predictions) over all windows. "
            "ppl_first_windows: the same over the first 8 windows only."),
        "perplexity_float": round(float_ppl["ppl"], 5),
        "perplexity_quantized": round(q_ppl["ppl"], 5),
        "perplexity_quantized_first_windows": round(q_ppl["ppl_first_windows"], 5),
        "perplexity_float_first_windows": round(float_ppl["ppl_first_windows"], 5),
        "n_eval_windows": q_ppl["n_windows"],
        "n_eval_predictions": q_ppl["n_predictions"],
        "quantized_weights": "the weights of default.gguf, read back with lazyggml.gguf_io.read_gguf "
                             "and dequantized with lazyggml.quants.dequantize, in the float32 PyTorch "
                             "model (activations not quantized)",
        "rope": "GGML normal mode (rope type 0, adjacent pairs); Q/K rows are not permuted",
        "samples_note": "greedy, quantized weights in PyTorch, prompt tokenized with BOS",
        "samples": samples,
        # vocabulary + training as recorded when the model was trained, export as just now (a run
        # with --from-ckpt re-exports without retraining)
        "time_s": {"vocabulary_and_tokenization": record.get("prep_s"), "training": record["seconds"],
                   "export_and_evaluation": round(time.time() - t_export, 1)},
        "exported_from_checkpoint": bool(args.from_ckpt),
    }
    figures["total_script_time_s"] = round(sum(v or 0 for v in figures["time_s"].values()), 1)
    with open(args.out / "default.json", "w") as f:
        json.dump(figures, f, indent=1)
        f.write("\n")
    print(f"wrote {gguf_path} ({size} bytes) and {args.out / 'default.json'}")


if __name__ == "__main__":
    main()
