"""llama.cpp (llama-cpp-python), the whole-model oracle, run in a child process: the helpers that
test_llama_cpp.py and test_real_files.py share.

A child interpreter (``sys.executable``; the test extra installs llama-cpp-python) keeps llama.cpp's
libggml apart from ggml-python's (loaded by other test modules), and ``GGML_CPU_TILED_MM`` is read
once per process, so each configuration gets its own child:

* as shipped (``reference`` False): ``Llama`` as a user runs it (on x86 it repacks Q4_0, Q4_K and
  IQ4_NL weights for gemv/gemm kernels of their own and runs prompt batches of K-quants through its
  tiled matmul);
* reference kernels (``reference`` True): no CPU_REPACK buffer and ``GGML_CPU_TILED_MM=0``, so that
  every weight matmul is GGML's ``vec_dot`` (or llamafile's tinyBLAS, which has no switch).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from lazyggml.backends.cpu import simd

__all__ = ["LLAMA_CPP_CHILD", "run_llama_cpp", "nmse"]


def nmse(a, b):
    """sum((a - b)^2) / sum(b^2), in float64: b is the oracle."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


# argv: the job file, the result file. The job: "reference" (bool), "flash_attn" (bool), "quantize" [{src, dst, mix,
# requantize}], "logits" [{path, n_ctx, tokens, out (.npy)}], "greedy" [{path, n_ctx, prompts, n, and optionally
# out: a prefix; the logits of every step of prompt i are saved to f"{out}-{i}.npy"}], "tokenize" [{path,
# texts}] (each text with BOS, parse_special False, as ``Model.tokenize``), "shift" [{path, n_ctx, first,
# n_keep, n_discard, then, out}]: a context shift (``first`` evaluated, the n_discard tokens after the
# first n_keep removed and the rest moved back by n_discard, ``then`` evaluated; its logits saved).
LLAMA_CPP_CHILD = r"""
import json, sys
import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as C

job = json.load(open(sys.argv[1]))
if job["reference"]:
    # every model of this process loads without the extra (CPU_REPACK) buffer types, so its weights
    # stay in the GGUF layout for GGML's vec_dot kernels (GGML_CPU_TILED_MM=0 is in the environment)
    _default_params = C.llama_model_default_params
    def _params():
        p = _default_params()
        p.use_extra_bufts = False
        return p
    C.llama_model_default_params = _params

for q in job.get("quantize", []):
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + q["mix"].upper())
    p.nthread = 2
    p.allow_requantize = q["requantize"]
    rc = llama_cpp.llama_model_quantize(q["src"].encode(), q["dst"].encode(), p)
    if rc != 0:
        sys.exit(f"llama_model_quantize({q}) returned {rc}")

def load(path, n_ctx):
    return llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=2, logits_all=True, verbose=False,
                           flash_attn=job["flash_attn"])

for e in job.get("logits", []):
    llm = load(e["path"], e["n_ctx"])
    llm.eval(e["tokens"])
    np.save(e["out"], np.array(llm.scores[:len(e["tokens"])], np.float32))
    llm.close()

greedy = {}
for e in job.get("greedy", []):
    llm = load(e["path"], e["n_ctx"])
    res = []
    for text in e["prompts"]:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        llm.reset()                     # a fresh KV cache: no prefix reuse from the last prompt
        llm.eval(ids)
        gen, steps = [], []
        while True:                     # greedy: the first of the largest logits (llama.cpp's greedy sampler)
            steps.append(np.array(llm.scores[llm.n_tokens - 1], np.float32))
            gen.append(int(np.argmax(steps[-1])))
            if len(gen) == e["n"]:
                break
            llm.eval(gen[-1:])
        if e.get("out"):
            np.save(f"{e['out']}-{len(res)}.npy", np.array(steps))
        res.append({"prompt_ids": [int(i) for i in ids], "ids": gen})
    greedy[e["path"]] = res
    llm.close()

for e in job.get("shift", []):
    llm = load(e["path"], e["n_ctx"])
    llm.eval(e["first"])
    keep, discard = e["n_keep"], e["n_discard"]
    llm._ctx.kv_cache_seq_rm(0, keep, keep + discard)
    llm._ctx.kv_cache_seq_shift(0, keep + discard, -1, -discard)
    llm.n_tokens -= discard
    llm.eval(e["then"])
    np.save(e["out"], np.array(llm.scores[llm.n_tokens - len(e["then"]):llm.n_tokens], np.float32))
    llm.close()

tokens = {}
for e in job.get("tokenize", []):
    llm = llama_cpp.Llama(e["path"], vocab_only=True, verbose=False)
    tokens[e["path"]] = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in e["texts"]]
    llm.close()

json.dump({"version": llama_cpp.__version__, "avx512": b"AVX512 = 1" in llama_cpp.llama_print_system_info(),
           "greedy": greedy, "tokens": tokens}, open(sys.argv[2], "w"))
"""


def run_llama_cpp(job, workdir, name):
    """Run ``job`` (see LLAMA_CPP_CHILD) in a child interpreter; its JSON result."""
    job_file, result_file = workdir / f"{name}.job.json", workdir / f"{name}.result.json"
    job_file.write_text(json.dumps(job))
    env = dict(os.environ)
    if job["reference"]:
        env["GGML_CPU_TILED_MM"] = "0"
    else:
        env.pop("GGML_CPU_TILED_MM", None)
    r = subprocess.run([sys.executable, "-c", LLAMA_CPP_CHILD, str(job_file), str(result_file)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, f"the llama.cpp child ({name}) failed ({r.returncode}):\n{r.stderr[-6000:]}"
    res = json.loads(result_file.read_text())
    assert res["avx512"] == simd.HAVE_AVX512, (
        f"llama.cpp was built {'with' if res['avx512'] else 'without'} AVX-512 and ggml-python (whose build "
        f"tests/conftest.py follows) {'with' if simd.HAVE_AVX512 else 'without'}: build both with README.md's test command")
    return res
