"""Our CUDA kernels' sources run as C++ on the CPU, where no GPU is.

A kernel's header and body are compiled unchanged under a few shims: each
CUDA thread of a block is a fiber (``ucontext``) that the launcher resumes in
turn; ``__syncthreads`` holds a thread until every thread of its block is at
a barrier, and a warp shuffle holds a lane until its warp's 32 lanes are at
one (warps may walk loops of different lengths, as on a GPU), and so does a
warp's MMA (``warp_mma``: ``mma.sync`` m16n8k16 computed from the lanes'
fragments as PTX lays them out); a barrier, shuffle or MMA that some thread
never reaches is an error; ``__shared__`` is a
function's static (blocks run one after another), and bfloat16 is its bits
with round-to-nearest-even. The tests that use it (``tests/test_qmv_source.py``,
``tests/test_attention_source.py``) hold a kernel to float64 and its variants
to each other, bit for bit: the arithmetic a GPU would run, checked wherever
a C++ compiler is.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np

CXX = shutil.which("g++") or shutil.which("clang++")

# CUDA's names for what the kernels use, on the CPU.
SHIMS = r"""
#if defined(__APPLE__)
#define _XOPEN_SOURCE 700  // macOS declares the ucontext calls only under it
#endif
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <ucontext.h>
#include <vector>
using std::max;
using std::min;
using std::size_t;
#define __device__
#define __global__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct uint4 { uint32_t x, y, z, w; };
struct float4 { float x, y, z, w; };
struct dim3 { unsigned x = 0, y = 0, z = 0; };
static dim3 threadIdx, blockIdx;
inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
struct bf16 {
    uint16_t bits;
    bf16() = default;
    explicit bf16(float f) {
        uint32_t u; std::memcpy(&u, &f, 4);
        bits = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);  // nearest, ties even
    }
    operator float() const { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
};

// The launcher: a block's threads as fibers. A barrier holds a thread until
// every thread of the block reaches one; a shuffle holds a lane until its
// warp's 32 lanes reach one, then each takes its partner's value.
constexpr int MAX_THREADS = 1024;  // a block's threads at most (CUDA's limit)
enum State { RUNNING, AT_SHUFFLE, AT_MMA, AT_BARRIER, DONE };
static ucontext_t scheduler, fibers[MAX_THREADS];
static State state[MAX_THREADS];
static float offered[MAX_THREADS], received[MAX_THREADS];
static int offsets[MAX_THREADS];
static uint32_t mma_a[MAX_THREADS][4], mma_b[MAX_THREADS][2];
static float mma_c[MAX_THREADS][4];
static bool mma_f16[MAX_THREADS];
static int current;
static void (*body)();
static void wait_as(State why) { state[current] = why; swapcontext(&fibers[current], &scheduler); }
inline void __syncthreads() { wait_as(AT_BARRIER); }
inline float __shfl_xor_sync(unsigned, float value, int offset) {
    offered[current] = value;
    offsets[current] = offset;
    wait_as(AT_SHUFFLE);
    return received[current];
}
// mma.sync.aligned.m16n8k16 (float32 C and D, bfloat16 or float16 A and B)
// as a warp's collective: each lane hands in its fragments and gets its four
// floats of D, laid out as PTX defines them (lane = 4 g + t: A rows g and
// g + 8 at k 2t, 2t + 1 and 2t + 8, 2t + 9; B those k at column g; C and D
// rows g and g + 8 at columns 2t, 2t + 1). Products are exact in float (at
// most 11-bit significands); each output's sum runs over k in order.
inline float half_to_float(uint16_t h) {
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0) return (sign ? -1.0f : 1.0f) * std::ldexp(static_cast<float>(mantissa), -24);
    if (exponent == 31) return __uint_as_float(sign | 0x7F800000u | (mantissa << 13));
    return __uint_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}
inline float mma_element(uint32_t word, int half, bool f16) {
    const uint16_t bits = static_cast<uint16_t>(half ? word >> 16 : word & 0xFFFFu);
    return f16 ? half_to_float(bits) : __uint_as_float(static_cast<uint32_t>(bits) << 16);
}
static void resolve_mma(int w) {
    float a[16][16], b[16][8];
    for (int l = 0; l < 32; ++l) {
        const int lane = w + l, g = l / 4, t = l % 4;
        const bool f16 = mma_f16[lane];
        for (int e = 0; e < 2; ++e) {
            a[g][2 * t + e] = mma_element(mma_a[lane][0], e, f16);
            a[g + 8][2 * t + e] = mma_element(mma_a[lane][1], e, f16);
            a[g][2 * t + 8 + e] = mma_element(mma_a[lane][2], e, f16);
            a[g + 8][2 * t + 8 + e] = mma_element(mma_a[lane][3], e, f16);
            b[2 * t + e][g] = mma_element(mma_b[lane][0], e, f16);
            b[2 * t + 8 + e][g] = mma_element(mma_b[lane][1], e, f16);
        }
    }
    float d[32][4];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int e = 0; e < 4; ++e) {
            const int row = g + 8 * (e / 2), column = 2 * t + e % 2;
            float sum = mma_c[w + l][e];
            for (int k = 0; k < 16; ++k) sum += a[row][k] * b[k][column];
            d[l][e] = sum;
        }
    }
    for (int l = 0; l < 32; ++l) std::memcpy(mma_c[w + l], d[l], sizeof d[l]);
}
inline void warp_mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1, bool f16) {
    std::memcpy(mma_a[current], a, sizeof mma_a[current]);
    mma_b[current][0] = b0;
    mma_b[current][1] = b1;
    std::memcpy(mma_c[current], c, sizeof mma_c[current]);
    mma_f16[current] = f16;
    wait_as(AT_MMA);
    std::memcpy(c, mma_c[current], sizeof mma_c[current]);
}
static void trampoline() { body(); state[current] = DONE; }
// Runs `grid` blocks of `threads` (a multiple of 32); false where the block
// cannot go on: a thread waits at a barrier or shuffle that another thread
// of its block or warp never reaches (on a GPU a hang or stale lanes).
static bool launch(void (*kernel)(), int grid, int threads) {
    static std::vector<char> stacks(static_cast<size_t>(MAX_THREADS) * 65536);
    body = kernel;
    for (int b = 0; b < grid; ++b) {
        blockIdx.x = b;
        for (int t = 0; t < threads; ++t) {
            getcontext(&fibers[t]);
            fibers[t].uc_stack.ss_sp = stacks.data() + static_cast<size_t>(t) * 65536;
            fibers[t].uc_stack.ss_size = 65536;
            fibers[t].uc_link = &scheduler;
            makecontext(&fibers[t], trampoline, 0);
            state[t] = RUNNING;
        }
        for (;;) {
            bool moved = false;
            for (int t = 0; t < threads; ++t) {
                if (state[t] != RUNNING) continue;
                current = t;
                threadIdx.x = t;
                swapcontext(&scheduler, &fibers[t]);
                moved = true;
            }
            for (int w = 0; w < threads; w += 32) {
                bool shuffle = true, mma = true;
                for (int l = w; l < w + 32; ++l) {
                    shuffle = shuffle && state[l] == AT_SHUFFLE;
                    mma = mma && state[l] == AT_MMA;
                }
                if (shuffle) {
                    for (int l = w; l < w + 32; ++l) received[l] = offered[w | ((l & 31) ^ offsets[l])];
                } else if (mma) {
                    resolve_mma(w);
                } else {
                    continue;
                }
                for (int l = w; l < w + 32; ++l) state[l] = RUNNING;
                moved = true;
            }
            int barrier = 0, done = 0;
            for (int t = 0; t < threads; ++t) {
                barrier += state[t] == AT_BARRIER;
                done += state[t] == DONE;
            }
            if (done == threads) break;
            if (barrier == threads) {
                for (int t = 0; t < threads; ++t) state[t] = RUNNING;
                moved = true;
            }
            if (!moved) return false;
        }
    }
    return true;
}
"""

C_TYPES = {"float32": "float", "bfloat16": "bf16"}


def build(source: str, folder: Path, name: str) -> ctypes.CDLL:
    """*source* (the shims first) built as a shared library in *folder* and
    loaded; the compiler's errors in the assertion where it fails."""
    text, built = folder / f"{name}.cpp", folder / f"{name}.so"
    text.write_text(source)
    done = subprocess.run(
        [CXX or "c++", "-std=c++17", "-O0", "-ffp-contract=off", "-Wno-unknown-pragmas",
         "-Wno-deprecated-declarations", "-shared", "-fPIC", "-o", str(built), str(text)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return ctypes.CDLL(str(built))


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Float32 values cut to bfloat16 (their top 16 bits), as those bits."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def floats(bits_or_values: np.ndarray) -> np.ndarray:
    """float64 values of bfloat16 bits (uint16) or of floats."""
    if bits_or_values.dtype == np.uint16:
        return (bits_or_values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits_or_values.astype(np.float64)


def pointer(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)
