// Prefill matrix products: bf16 activations times 4-bit (or 8-bit) weights on tensor cores. (being written)
__device__ int moe_tile_rows = 64;
extern "C" __global__ void gemm_q4(const bf16* a, int m, Q4 w, int n, int k, float* out, int accumulate) {}
extern "C" __global__ void gemm_q8(const bf16* a, int m, Q4 w, int n, int k, float* out, int accumulate) {}
extern "C" __global__ void gemm_q4_swiglu(const bf16* a, int m, Q4 gate, Q4 up, int n, int k, bf16* out) {}
extern "C" __global__ void moe_gate_up(const bf16* x, const int* entries, const int* tiles, const int* tile_count,
                                       const int* offsets, Q4 gate, Q4 up, bf16* act) {}
extern "C" __global__ void moe_down(const bf16* act, const int* entries, const int* tiles, const int* tile_count,
                                    const int* offsets, const float* route_w, Q4 down, float* out) {}
