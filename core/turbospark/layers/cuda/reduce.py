"""The warp and block reductions every CUDA kernel here shares, as one header.

Each kernel module passes :data:`HEADER` (ahead of any header of its own) to
:class:`~turbospark.layers.cuda.kernel.Kernel`, so a sum is reduced the same
way in the norms, the heads, the attention merge, the steering and the gated
delta rule, and a fix to one is a fix to all of them.
"""

HEADER = """
#define NEG_INF __int_as_float(static_cast<int>(0xff800000u))  // -infinity
// A warp's float32 sum, which every lane gets.
__device__ inline float warp_sum(float value) {
    for (int offset = 16; offset > 0; offset >>= 1)
        value += __shfl_xor_sync(0xffffffff, value, offset);
    return value;
}
// A block's maximum or sum, which every thread gets (BLOCK threads, a multiple
// of 32, and every one calls it; scratch holds BLOCK / 32 floats).
template <int BLOCK, bool MAX>
__device__ inline float block_reduce(float value, float* scratch) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffff, value, offset);
        value = MAX ? fmaxf(value, other) : value + other;
    }
    if constexpr (BLOCK > 32) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        __syncthreads();  // scratch may still hold the last reduction's partials
        if (lane == 0) scratch[warp] = value;
        __syncthreads();
        value = lane < BLOCK / 32 ? scratch[lane] : (MAX ? NEG_INF : 0.0f);
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(0xffffffff, value, offset);
            value = MAX ? fmaxf(value, other) : value + other;
        }
    }
    return value;
}
template <int BLOCK>
__device__ inline float block_sum(float value, float* scratch) {
    return block_reduce<BLOCK, false>(value, scratch);
}
"""
