// Synthetic weights generated in place, bit for bit what lily_model::synth::SynthTensor::bytes() produces (the
// same counter-based hash: every element is a function of seed, stream and index alone); and random fills for
// benchmark state.

// Fill::Packed: the low 32 bits of the hash.
extern "C" __global__ void synth_packed(u32* out, u64 n, u64 seed, u64 stream) {
    wait_previous();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = (u32)hash3(seed, stream, i);
}

// Fill::Scales and Fill::Biases of one matrix (they share a stream), written as (scale, bias) pairs.
extern "C" __global__ void synth_scale_bias(u32* out, u64 n, u64 seed, u64 stream, float base,
                                            float levels) {
    wait_previous();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float scale = bf16_to_float(float_to_bf16(__fmul_rn(base, __fadd_rn(0.5f, uniform_at(seed, stream, i)))));
        const float bias = __fdiv_rn(__fmul_rn(-scale, levels), 2.f);
        out[i] = (u32)float_to_bf16(scale) | ((u32)float_to_bf16(bias) << 16);
    }
}

// Benchmark state: lo + (hi - lo) * u, as f32, bf16 or f16.
extern "C" __global__ void fill_uniform_f32(float* out, u64 n, u64 seed, u64 stream, float lo, float hi) {
    wait_previous();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = lo + (hi - lo) * uniform_at(seed, stream, i);
}
extern "C" __global__ void fill_uniform_bf16(bf16* out, u64 n, u64 seed, u64 stream, float lo, float hi) {
    wait_previous();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = float_to_bf16(lo + (hi - lo) * uniform_at(seed, stream, i));
}
extern "C" __global__ void fill_uniform_f16(f16* out, u64 n, u64 seed, u64 stream, float lo, float hi) {
    wait_previous();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = float_to_f16(lo + (hi - lo) * uniform_at(seed, stream, i));
}
