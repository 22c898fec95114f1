#!/bin/sh
# C/C++ flags for building the oracles of the tests (ggml-python, llama-cpp-python), used by README.md's
# test command. GGML builds for the machine it is built on (-march=native); on a CPU with AVX512-FP16
# and AMX (Intel Sapphire Rapids and later) that adds two paths lazyggml does not mirror:
# * AVX512-FP16: GGML's F16 dot products accumulate in half precision (results off by ~1e-3 from
#   the F32 accumulation of every other x86 and ARM build, and of lazyggml);
# * AMX: llama.cpp moves quantized weights into AMX tiles, which a sandbox may not allow (the
#   process gets SIGSEGV at the first prompt).
# So the oracles are built without both, where the compiler knows the flags (x86 GCC 12+, Clang 14+);
# elsewhere this prints nothing and the native build is the oracle.
f="-mno-avx512fp16 -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if echo 'int x;' | ${CC:-cc} $f -x c -c - -o /dev/null 2>/dev/null; then echo "$f"; fi
