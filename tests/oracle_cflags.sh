#!/bin/sh
# C/C++ flags for building the oracles of the tests (ggml-python, llama-cpp-python), used by README.md's
# test command. GGML builds for the machine it is built on (-march=native). On an x86 CPU with
# AVX-512 the oracles are built as for AVX2 (x86-64-v3), the GGML whose bits the tests assert:
# * AVX-512: GGML adds float lanes 16 wide (F32/F16 dot products, llamafile's sgemm, soft_max sums,
#   its vector exp and silu), so last bits differ from the AVX2 build, and trained models (Gemma 3,
#   SmolLM2) grow them to NMSE ~1e-2 by the last layer; with AVX512-FP16 its F16 dot products even
#   accumulate in half precision. lazyggml follows the AVX2 order there when LAZYGGML_GGML_AVX512=0,
#   which tests/conftest.py sets from the oracle's build;
# * AMX: llama.cpp moves quantized weights into AMX tiles, which a sandbox may not allow (the
#   process gets SIGSEGV at the first prompt).
# Where the compiler does not know these flags (not x86 GCC/Clang) this prints nothing and the native
# build is the oracle.
f="-mno-avx512f -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if echo 'int x;' | ${CC:-cc} $f -x c -c - -o /dev/null 2>/dev/null; then echo "$f"; fi
