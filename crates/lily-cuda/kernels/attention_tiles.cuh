// Shared by the attention files (put in front of attention.cu and attention_prefill.cu, after common.cuh): rows of
// HEAD_DIM bf16 in shared memory, brought by cp.async and read by ldmatrix into mma.sync m16n8k16 fragments.

#define ROW_BYTES (HEAD_DIM * 2)
#define ROW_CHUNKS (ROW_BYTES / 16)  // 16-byte chunks in a row of HEAD_DIM bf16

__device__ __forceinline__ u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// A row's 16-byte chunk `c` is stored at chunk c ^ (row % 8): ldmatrix's 8 rows of one chunk hit 8 bank groups.
__device__ __forceinline__ u32 swizzled(int row, int chunk) { return row * ROW_BYTES + ((chunk ^ (row & 7)) << 4); }
