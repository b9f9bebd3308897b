// Gated full attention prefill. (being written)
extern "C" __global__ void attn_prefill_prep() {}
extern "C" __global__ void attn_prefill() {}
