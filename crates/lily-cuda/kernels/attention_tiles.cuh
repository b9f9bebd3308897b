// Shared by the attention files (put in front of attention.cu and attention_prefill.cu, after common.cuh): rows of
// HEAD_DIM bf16 in shared memory, brought by cp.async and read by ldmatrix into mma.sync m16n8k16 fragments.

#define ROW_BYTES (HEAD_DIM * 2)
#define ROW_CHUNKS (ROW_BYTES / 16)  // 16-byte chunks in a row of HEAD_DIM bf16

__device__ __forceinline__ u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// A row's 16-byte chunk `c` is stored at chunk c ^ (row % 8): ldmatrix's 8 rows of one chunk hit 8 bank groups.
__device__ __forceinline__ u32 swizzled(int row, int chunk) { return row * ROW_BYTES + ((chunk ^ (row & 7)) << 4); }

// 16 bytes global -> shared; when !valid the shared bytes are zeroed and nothing is read.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// d += a b for a 16x16 bf16 A fragment and a 16x8 bf16 B fragment (b0, b1), f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16 (round to nearest even), `lo` in the low half (the lower address / column).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
