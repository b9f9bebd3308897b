// Gated DeltaNet prefill. (being written)
extern "C" __global__ void gdn_prefill_conv() {}
extern "C" __global__ void gdn_prefill_chunks() {}
extern "C" __global__ void gdn_prefill_norm() {}
