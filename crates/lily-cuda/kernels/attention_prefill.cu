// Gated full attention, prefill: `tokens` new tokens at positions start .. start+tokens-1, from the q/k/v input
// projection (`proj`, f32 [token][2 Q_DIM + 2 KV_DIM], per query head [query | gate], then k, then v) to the o_proj
// GEMM's input (`out`, bf16 [token][Q_DIM], query head h at columns h*HEAD_DIM..), attention times sigmoid(gate).
//
// attn_prefill_prep, one warp per (token, head), a lane holding 8 dims: q rmsnorm, partial RoPE, times
// 1/sqrt(HEAD_DIM), into the q buffer (bf16 [token][N_HEADS][HEAD_DIM]); k rmsnorm + RoPE and v into the bf16 KV
// pools (pages of KV_PAGE positions, [page][KV_PAGE][N_KV_HEADS][HEAD_DIM]) at the token's position, through the
// sequence's page-table row `pages` (see kv_offset in common.cuh).
//
// attn_prefill, causal flash attention on tensor cores (mma.sync m16n8k16 bf16, f32 accumulation). Work split: a
// block takes a tile of QUERY_TILE (16) consecutive query tokens for the GQA (8) query heads of one KV head: 128
// rows, warp w holding query head w of the group for the 16 tokens (m16 = tokens, so each K/V tile loaded into shared
// memory serves all 8 heads). The block walks the keys 0 .. (its last token's position) in tiles of KEY_TILE (64)
// keys (a tile is one page of the pools), K and V double-buffered through cp.async (the next tile loads while
// this one is used), ldmatrix fragments from XOR-swizzled rows; S = Q K^T and O += P V per warp with the online
// softmax in registers (the S accumulators become P's A fragments in place), O (16 x 256 f32) lives in registers. Only tiles reaching past the block's first
// query position are masked. Blocks run the longest key ranges first (the causal tail is the short tiles).
// When query tiles x KV heads would leave SMs idle (a short prompt after a long prefix, or a short prompt), the
// key range is also split into chunks of `chunk` keys (grid.y): each block writes its unnormalised O with the
// row's max and sum (flash-decoding), and attn_prefill_merge combines the parts and applies the gate. With one
// chunk (grid.y == 1) attn_prefill normalises, gates and stores the output itself.
//
// Shared memory of attn_prefill (dynamic): Q 128 rows + K 2 x 64 rows + V 2 x 64 rows of HEAD_DIM bf16 = 192 KiB,
// one block (8 warps) per SM.

#define GQA (N_HEADS / N_KV_HEADS)
#define QUERY_TILE 16
#define KEY_TILE 64
#define PF_THREADS (GQA * WARP)
#define Q_TILE_BYTES (GQA * QUERY_TILE * ROW_BYTES)
#define KV_TILE_BYTES (KEY_TILE * ROW_BYTES)
#define PROJ_ROW (2 * Q_DIM + 2 * KV_DIM)
#define LOG2E 1.4426950408889634f
static_assert(HEAD_DIM == 256, "the O accumulators hold 256 dims per row");
static_assert(GQA == 8, "a block's warps are the 8 query heads of a KV head");
static_assert(KEY_TILE == KV_PAGE, "a key tile is one page of the KV pools");
static_assert(ROT_DIM % 16 == 0 && ROT_DIM <= HEAD_DIM, "RoPE pairs move between whole lanes of 8 dims");
static_assert(PF_THREADS * 16 == GQA * QUERY_TILE * ROW_CHUNKS, "16 Q chunks per thread");
static_assert(PF_THREADS * 8 == KEY_TILE * ROW_CHUNKS, "8 K (and V) chunks per thread");

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
    const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8_bf16(const bf16* p, float (&v)[8]) {
    const uint4 raw = *(const uint4*)p;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 w = word_of(raw, i);
        v[2 * i] = __uint_as_float(w << 16), v[2 * i + 1] = __uint_as_float(w & 0xffff0000u);
    }
}
__device__ __forceinline__ void store8_bf16(bf16* p, const float (&v)[8]) {
    *(uint4*)p = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                            pack_bf16x2(v[6], v[7]));
}

#define PREP_THREADS 256
// Grid: ceil(tokens * (N_HEADS + N_KV_HEADS) / 8) blocks of 256 threads; warp item = token * (heads) + head, the
// query heads first, then the KV heads (key and value).
extern "C" __global__ void __launch_bounds__(PREP_THREADS)
    attn_prefill_prep(const float* proj, const float* q_norm, const float* k_norm, const float* inv_freq, int tokens,
                      int start, bf16* q_out, bf16* k_pool, bf16* v_pool, const int* pages) {
    wait_previous();
    constexpr int HEADS = N_HEADS + N_KV_HEADS;
    const int lane = threadIdx.x % WARP;
    const int item = blockIdx.x * (PREP_THREADS / WARP) + threadIdx.x / WARP;
    if (item >= tokens * HEADS) return;
    const int token = item / HEADS, head = item % HEADS;
    const bool is_query = head < N_HEADS;
    const int kv_head = head - N_HEADS;
    const int d0 = lane * 8;
    const float* row = proj + (size_t)token * PROJ_ROW;
    float x[8], w[8], v[8];
    load8(is_query ? row + head * 2 * HEAD_DIM + d0 : row + 2 * Q_DIM + kv_head * HEAD_DIM + d0, x);
    load8((is_query ? q_norm : k_norm) + d0, w);
    if (!is_query) load8(row + 2 * Q_DIM + KV_DIM + kv_head * HEAD_DIM + d0, v);
    float squares = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) squares += x[i] * x[i];
    const float inv = 1.f / sqrtf(warp_sum(squares) / HEAD_DIM + RMS_EPS);
#pragma unroll
    for (int i = 0; i < 8; i++) x[i] = x[i] * inv * w[i];

    // Rotate-half pairs (i, i + ROT_DIM/2): lane l < HALF_LANES holds the low dims, lane l + HALF_LANES the high.
    constexpr int HALF = ROT_DIM / 2, HALF_LANES = HALF / 8;
    const int position = start + token;
    const int partner_lane = lane < HALF_LANES ? lane + HALF_LANES : lane - HALF_LANES;
    float partner[8];
#pragma unroll
    for (int i = 0; i < 8; i++) partner[i] = __shfl_sync(0xffffffffu, x[i], partner_lane);
    if (lane < ROT_DIM / 8) {
        const bool low = lane < HALF_LANES;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float sn, cs;
            sincosf((float)position * inv_freq[(d0 + i) % HALF], &sn, &cs);
            x[i] = low ? x[i] * cs - partner[i] * sn : x[i] * cs + partner[i] * sn;
        }
    }
    if (is_query) {
#pragma unroll
        for (int i = 0; i < 8; i++) x[i] *= 1.f / sqrtf((float)HEAD_DIM);
        store8_bf16(q_out + ((size_t)token * N_HEADS + head) * HEAD_DIM + d0, x);
    } else {
        const size_t at = kv_offset(pages, position) + kv_head * HEAD_DIM + d0;
        store8_bf16(k_pool + at, x);
        store8_bf16(v_pool + at, v);
    }
}

// The epilogue of every attn_prefill kernel, for a lane holding rows g and g + 8 of its warp's 16 and the pairs of
// columns 8 n + 2 c (o[4 n + 2 r], o[4 n + 2 r + 1]: mma.sync's accumulator layout, which wgmma's shares): the quad's
// row sums, then with one key chunk the normalised, gated output (bf16 [token][Q_DIM]), with several the chunk's
// unnormalised rows and their (max, sum) for attn_prefill_merge.
__device__ __forceinline__ void attn_prefill_store(const float (&o)[HEAD_DIM / 2], const float (&row_max)[2],
                                                   float (&row_sum)[2], int tok0, int tokens, int head, int g, int c,
                                                   const float* proj, bf16* out, float* part_o, float* part_ml) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    }
    const bool single_chunk = gridDim.y == 1;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int token = tok0 + g + 8 * r;
        if (token >= tokens) continue;
        if (single_chunk) {
            const float inv_sum = 1.f / row_sum[r];
            const float* gate = proj + (size_t)token * PROJ_ROW + head * 2 * HEAD_DIM + HEAD_DIM;
            bf16* dst = out + (size_t)token * Q_DIM + head * HEAD_DIM;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; n++) {
                const int d = n * 8 + 2 * c;
                const float2 gt = *(const float2*)(gate + d);
                *(u32*)(dst + d) = pack_bf16x2(o[4 * n + 2 * r] * inv_sum * sigmoidf_(gt.x),
                                               o[4 * n + 2 * r + 1] * inv_sum * sigmoidf_(gt.y));
            }
        } else {
            const size_t part = ((size_t)blockIdx.y * tokens + token) * N_HEADS + head;
            float* dst = part_o + part * HEAD_DIM;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; n++)
                *(float2*)(dst + n * 8 + 2 * c) = make_float2(o[4 * n + 2 * r], o[4 * n + 2 * r + 1]);
            if (c == 0) *(float2*)(part_ml + part * 2) = make_float2(row_max[r], row_sum[r]);
        }
    }
}

// Grid (ceil(tokens / QUERY_TILE) * N_KV_HEADS, splits), PF_THREADS threads, Q_TILE_BYTES + 4 KV_TILE_BYTES of
// dynamic shared memory. Block x: KV head x % N_KV_HEADS, query tile (last first) x / N_KV_HEADS; block y: the
// chunk of keys [y * chunk, (y + 1) * chunk) (chunk a multiple of KEY_TILE). With one chunk: out = softmax(q k^T) v
// times sigmoid(gate). With several: part_o [split][token][N_HEADS][HEAD_DIM] the unnormalised output, part_ml
// [split][token][N_HEADS][2] the row's max (log2 units) and sum of exponentials.
extern "C" __global__ void __launch_bounds__(PF_THREADS, 1)
    attn_prefill(const bf16* q, const bf16* k_pool, const bf16* v_pool, const int* pages, const float* proj,
                 int tokens, int start, int chunk, bf16* out, float* part_o, float* part_ml) {
    wait_previous();
    extern __shared__ __align__(128) unsigned char smem[];
    const int tiles = (tokens + QUERY_TILE - 1) / QUERY_TILE;
    const int kv_head = blockIdx.x % N_KV_HEADS;
    const int tok0 = (tiles - 1 - (int)blockIdx.x / N_KV_HEADS) * QUERY_TILE;
    const int key_begin = blockIdx.y * chunk;
    const int key_end = min(key_begin + chunk, start + min(tok0 + QUERY_TILE, tokens));
    if (key_begin >= key_end) return;
    const int key_tiles = (key_end - key_begin + KEY_TILE - 1) / KEY_TILE;

    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int head = kv_head * GQA + warp;
    const u32 q_smem = shared_address(smem);
    const u32 k_smem = q_smem + Q_TILE_BYTES;                 // two tiles
    const u32 v_smem = k_smem + 2 * KV_TILE_BYTES;            // two tiles

    // Q rows: GQA heads x QUERY_TILE tokens (warp w's rows are w*16 .. w*16+15); tokens past the end read as zero.
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int c = threadIdx.x + i * PF_THREADS;
        const int row = c / ROW_CHUNKS, chunk16 = c % ROW_CHUNKS;
        const int token = tok0 + row % QUERY_TILE;
        const bool valid = token < tokens;
        const bf16* src = q + ((size_t)(valid ? token : tok0) * N_HEADS + kv_head * GQA + row / QUERY_TILE) * HEAD_DIM;
        cp_async_16(q_smem + swizzled(row, chunk16), src + chunk16 * 8, valid ? 16u : 0u);
    }
    // One K or V tile (key0 a multiple of KEY_TILE: one page): keys past key_end read as zero (V's zeros keep
    // 0 * garbage out of the P V product).
    auto load_tile = [&](u32 dst, const bf16* pool, int key0) {
        const bf16* page = pool + (size_t)pages[key0 / KV_PAGE] * KV_PAGE * KV_DIM + kv_head * HEAD_DIM;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int c = threadIdx.x + i * PF_THREADS;
            const int row = c / ROW_CHUNKS, chunk16 = c % ROW_CHUNKS;
            const int key = key0 + row;
            const bool valid = key < key_end;
            const bf16* src = page + (size_t)(valid ? row : 0) * KV_DIM;
            cp_async_16(dst + swizzled(row, chunk16), src + chunk16 * 8, valid ? 16u : 0u);
        }
    };
    cp_async_commit();
    load_tile(k_smem, k_pool, key_begin);
    cp_async_commit();
    load_tile(v_smem, v_pool, key_begin);
    cp_async_commit();

    // Fragment layout (mma m16n8k16): lane holds rows g and g + 8 (tokens tok0 + g, tok0 + g + 8), columns 2c, 2c+1
    // of each 8-wide n tile.
    const int g = lane / 4, c = lane % 4;
    // ldmatrix row addresses: for A (Q) and trans-B (V) lane L gives row L%8 + 8*(L/8 % 2), chunk + L/16; for B (K)
    // row L%8 + 8*(L/16), chunk + L/8 % 2. Every such row is = lane (mod 8), so the swizzle is `^ (lane & 7)`.
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_hi = lane >> 4;
    const int b_row = (lane & 7) + (lane >> 4) * 8, b_hi = (lane >> 3) & 1;
    const u32 q_warp = q_smem + warp * QUERY_TILE * ROW_BYTES;
    // Keys above a row's limit are masked: its own position (causal) and the chunk's end.
    const int limit0 = min(start + tok0 + g, key_end - 1), limit1 = min(start + tok0 + g + 8, key_end - 1);
    const int first_masked_from = min(start + tok0, key_end - 1);

    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float row_max[2] = {-INF_F, -INF_F};  // log2 units
    float row_sum[2] = {0.f, 0.f};        // this lane's columns only; the quad's sum at the end

    for (int it = 0; it < key_tiles; it++) {
        const int key0 = key_begin + it * KEY_TILE;
        const u32 k_tile = k_smem + (it & 1) * KV_TILE_BYTES, v_tile = v_smem + (it & 1) * KV_TILE_BYTES;
        cp_async_wait<1>();  // Q and this K tile have landed (this V tile may still be in flight)
        __syncthreads();     // ... for every thread; and every warp is done with the other buffers
        if (it + 1 < key_tiles) load_tile(k_smem + ((it + 1) & 1) * KV_TILE_BYTES, k_pool, key0 + KEY_TILE);
        cp_async_commit();
        if (it + 1 < key_tiles) load_tile(v_smem + ((it + 1) & 1) * KV_TILE_BYTES, v_pool, key0 + KEY_TILE);
        cp_async_commit();

        float s[KEY_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < KEY_TILE / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ks++) {
            u32 a[4];
            ldmatrix_x4(a, q_warp + a_row * ROW_BYTES + (((2 * ks + a_hi) ^ (lane & 7)) << 4));
#pragma unroll
            for (int np = 0; np < KEY_TILE / 16; np++) {
                u32 b[4];
                ldmatrix_x4(b, k_tile + (np * 16 + b_row) * ROW_BYTES + (((2 * ks + b_hi) ^ (lane & 7)) << 4));
                mma_bf16(s[2 * np], a, b[0], b[1]);
                mma_bf16(s[2 * np + 1], a, b[2], b[3]);
            }
        }
        if (key0 + KEY_TILE - 1 > first_masked_from) {
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = key0 + n * 8 + 2 * c + e;
                    if (key > limit0) s[n][e] = -INF_F;
                    if (key > limit1) s[n][2 + e] = -INF_F;
                }
            }
        }
        // Online softmax, rows g (r = 0) and g + 8 (r = 1); the quad's 4 lanes share a row.
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float m = -INF_F;
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++) m = fmaxf(m, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            const float new_max = fmaxf(row_max[r], m * LOG2E);
            const float base = new_max == -INF_F ? 0.f : new_max;  // a row that has seen only masked keys
            alpha[r] = exp2_approx(row_max[r] - base);
            row_max[r] = new_max;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++) {
                s[n][2 * r] = exp2_approx(fmaf(s[n][2 * r], LOG2E, -base));
                s[n][2 * r + 1] = exp2_approx(fmaf(s[n][2 * r + 1], LOG2E, -base));
                sum += s[n][2 * r] + s[n][2 * r + 1];
            }
            row_sum[r] = row_sum[r] * alpha[r] + sum;
        }
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; n++) {
            o[n][0] *= alpha[0], o[n][1] *= alpha[0];
            o[n][2] *= alpha[1], o[n][3] *= alpha[1];
        }
        // P as A fragments: keys 16j .. 16j+15 are the n tiles 2j (k 0..7) and 2j + 1 (k 8..15).
        u32 p[KEY_TILE / 16][4];
#pragma unroll
        for (int j = 0; j < KEY_TILE / 16; j++) {
            p[j][0] = pack_bf16x2(s[2 * j][0], s[2 * j][1]);
            p[j][1] = pack_bf16x2(s[2 * j][2], s[2 * j][3]);
            p[j][2] = pack_bf16x2(s[2 * j + 1][0], s[2 * j + 1][1]);
            p[j][3] = pack_bf16x2(s[2 * j + 1][2], s[2 * j + 1][3]);
        }

        cp_async_wait<2>();  // this V tile has landed (the next K and V may still be in flight)
        __syncthreads();
#pragma unroll
        for (int j = 0; j < KEY_TILE / 16; j++) {
#pragma unroll
            for (int dp = 0; dp < HEAD_DIM / 16; dp++) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_tile + (j * 16 + a_row) * ROW_BYTES + (((2 * dp + a_hi) ^ (lane & 7)) << 4));
                mma_bf16(o[2 * dp], p[j], b[0], b[1]);
                mma_bf16(o[2 * dp + 1], p[j], b[2], b[3]);
            }
        }
    }

    attn_prefill_store(reinterpret_cast<const float(&)[HEAD_DIM / 2]>(o), row_max, row_sum, tok0, tokens, head, g, c,
                       proj, out, part_o, part_ml);
}

// ---- attn_prefill on the warpgroup tensor cores (sm_90a) ----
// attn_prefill_wgmma computes what attn_prefill does, with the same grid, arguments, outputs and per-row ownership
// (warp w: query head w of the KV head's group, rows g and g + 8 its tokens g and g + 8 of the tile), on wgmma: the
// block's 128 rows (16 tokens x 8 heads) are two warpgroups of 64, S = Q K^T takes Q and the key tile straight from
// shared memory (m64n64k16, sixteen k16 steps over the 256 dims), and O += P V takes P from the registers that held
// S and the value tile from shared memory as copied, read transposed (m64n256k16, four k16 steps over the tile's 64
// keys), so no warp loads K or V fragments of its own. Each iteration issues S for its key tile and then O += P V
// for the tile before, and runs the softmax of S while the second product is on the tensor cores. Key tiles are
// copied two tiles ahead (three buffers), value tiles one ahead (two), all through cp.async. Operand tiles are
// 128-byte rows in 1,024-byte swizzle atoms, four k-blocks of 64 dims ([k-block][row][128 B]).
//
// Shared memory (dynamic, 1,024-aligned): Q 64 KiB, K 3 x 32 KiB, V 2 x 32 KiB: 224 KiB, one block an SM. sm_90a
// builds have it unless ATTN_PREFILL_WGMMA is 0; the host reads attn_prefill_wgmma_built and runs attn_prefill
// where it is 0 (other GPUs).
#ifndef ATTN_PREFILL_WGMMA
#define ATTN_PREFILL_WGMMA 1
#endif
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && ATTN_PREFILL_WGMMA
#define APW_BUILT 1
#else
#define APW_BUILT 0
#endif
#define APW_ROWS (GQA * QUERY_TILE)              // 128 rows: (head, token), head major
#define APW_Q_BYTES (APW_ROWS * ROW_BYTES)       // 64 KiB
#define APW_KV_BYTES (KEY_TILE * ROW_BYTES)      // 32 KiB a key or value tile
#define APW_SMEM (APW_Q_BYTES + 5 * APW_KV_BYTES + 1024)
static_assert(APW_ROWS == 2 * 64 && PF_THREADS == 256, "two warpgroups of 64 rows");
static_assert(KEY_TILE == 64 && HEAD_DIM == 256, "a key tile is 64 rows of four k-blocks");
__device__ int attn_prefill_wgmma_built = APW_BUILT;
__device__ int attn_prefill_wgmma_smem = APW_SMEM;

// Where 16-byte chunk c (0 .. ROW_CHUNKS) of row r of a ROWS-row operand tile lies: k-block c / 8, then the row's
// 128 bytes with the chunk swizzled.
template <int ROWS>
__device__ __forceinline__ u32 apw_at(int r, int c) {
    return (c / 8) * (ROWS * 128) + r * 128 + (((c % 8) ^ (r & 7)) << 4);
}

#if APW_BUILT
// s = A (64 x 16, shared) B (64 x 16, shared)^T (+ s unless scale_d is 0): 32 f32 a thread.
// The accumulators of the warpgroup MMAs below as asm operands: APW_D8(i) binds d[i .. i + 7]; APW_O128 binds the
// 128 of an m64n256 product, which its asm names APW_O128_REGS.
#define APW_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                  "+f"(d[i + 6]), "+f"(d[i + 7])
#define APW_O128 APW_D8(0), APW_D8(8), APW_D8(16), APW_D8(24), APW_D8(32), APW_D8(40), APW_D8(48), APW_D8(56), \
                 APW_D8(64), APW_D8(72), APW_D8(80), APW_D8(88), APW_D8(96), APW_D8(104), APW_D8(112), APW_D8(120)
#define APW_O128_REGS                                                                 \
    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                           \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                 \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                 \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"                 \
    "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"                 \
    "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"                 \
    "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"     \
    "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
__device__ __forceinline__ void apw_m64n64k16(float (&d)[32], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : APW_D8(0), APW_D8(8), APW_D8(16), APW_D8(24)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
// d += A (64 x 16, registers: the mma.sync A fragment of each warp's 16 rows) B (16 x 256, shared, rows of 256
// dims: the value tile as copied, which wgmma reads transposed): 128 f32.
__device__ __forceinline__ void apw_m64n256k16_rs_t(float (&d)[128], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        APW_O128_REGS
        "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        : APW_O128
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// The descriptor of 16 keys x 256 dims of a value tile at `addr` (rows of keys, 64 dims a 128-byte swizzled row, the
// four 64-dim blocks KEY_TILE rows apart) as wgmma's MN-major B: 64 dims a row, the next 64 dims 8 KiB on (LBO), the
// next 8 keys 1 KiB on (SBO).
__device__ __forceinline__ u64 apw_v_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((KEY_TILE * 128) >> 4) << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}
// Keeps P's registers, which an issued O += P V reads, from being reused before the wait for it.
__device__ __forceinline__ void apw_hold(u32 (&p)[KEY_TILE / 16][4]) {
#pragma unroll
    for (int j = 0; j < KEY_TILE / 16; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) asm volatile("" : "+r"(p[j][i])::"memory");
}
#endif

// ---- attn_prefill with 8-bit integer scores (sm_90a) ----
// attn_prefill_i8 computes what attn_prefill_wgmma does, with S = Q K^T on the integer tensor cores (wgmma
// m64n64k32 s8 x s8 into s32, twice bf16's rate): q and k as 8-bit codes with a scale per (token, head), k after
// subtracting a mean key of its KV head (SageAttention's smoothing: it moves all scores of a query by the same
// amount, so the softmax not at all, and takes the channels every key shares out of the per-key scale). O += P V
// stays on bf16 as in attn_prefill_wgmma. lily_model::cpu::numerics measured this format (int8 scores only) at the
// prompt path's bf16 error on the bundled model.
//
// Two kernels write the codes before it, for every position of the sequence up to the call's last (the mean
// changes as the context grows, so older positions are coded again; at 128K positions that reads 128 MiB a
// layer): attn_prefill_key_mean, the mean of up to 256 keys evenly spaced over the context, per KV head; then
// attn_prefill_codes, one warp per query row (token, head) and per key row (position, KV head).
//
// Code buffers: q8 [token][N_HEADS][HEAD_DIM] with q_scale [token][N_HEADS]; k8 [position][N_KV_HEADS][HEAD_DIM]
// with k_scale [N_KV_HEADS][scale_stride] (scale_stride a multiple of KEY_TILE, at least the positions). A code is
// round(x / scale), scale = max |x| / 127, so a score's s32 sum stays below 127 * 127 * HEAD_DIM < 2^22.
// When the host runs it (attn_prefill_i8_default): ATTN_PREFILL_I8 0 never, 1 for every call, 2 (the default) for
// calls long enough that the attention's products weigh (see Int8Scores in src/prefill_attention.rs).
#ifndef ATTN_PREFILL_I8
#define ATTN_PREFILL_I8 2
#endif
#if APW_BUILT
#define API_BUILT 1
#else
#define API_BUILT 0
#endif
#define API_ROW_BYTES HEAD_DIM                   // one byte a dim
#define API_ROW_CHUNKS (API_ROW_BYTES / 16)
#define API_Q_BYTES (APW_ROWS * API_ROW_BYTES)   // 32 KiB
#define API_K_BYTES (KEY_TILE * API_ROW_BYTES)   // 16 KiB a key tile
#define API_SMEM (API_Q_BYTES + 3 * API_K_BYTES + 2 * APW_KV_BYTES + 3 * KEY_TILE * 4 + 1024)
#define MEAN_SAMPLES 256
static_assert(API_ROW_BYTES == 2 * 128, "a code row is two 128-byte k-blocks");
static_assert(127 * 127 * HEAD_DIM < (1 << 22), "a score's s32 sum converts exactly through the 1.5 * 2^23 trick");
__device__ int attn_prefill_i8_built = API_BUILT;
__device__ int attn_prefill_i8_default = ATTN_PREFILL_I8;
__device__ int attn_prefill_i8_smem = API_SMEM;

// Grid N_KV_HEADS blocks of 256 threads: mean[kv_head][HEAD_DIM] over the keys at positions (j * len) / n, j < n =
// min(len, MEAN_SAMPLES), len = start + tokens; warp w sums samples w, w + 8, ..., a lane 8 dims. Where v_max is not
// null it also clears the KV head's largest value magnitude, which attn_prefill_v_max then raises.
extern "C" __global__ void __launch_bounds__(256)
    attn_prefill_key_mean(const bf16* k_pool, const int* pages, int tokens, int start, float* mean, float* v_max) {
    wait_previous();
    if (v_max && threadIdx.x == 0) v_max[blockIdx.x] = 0.f;
    __shared__ float partial[8][HEAD_DIM];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, h = blockIdx.x;
    const int len = start + tokens, n = min(len, MEAN_SAMPLES);
    float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = warp; j < n; j += 8) {
        const int position = (int)((long long)j * len / n);
        float v[8];
        load8_bf16(k_pool + kv_offset(pages, position) + h * HEAD_DIM + lane * 8, v);
#pragma unroll
        for (int i = 0; i < 8; i++) sum[i] += v[i];
    }
#pragma unroll
    for (int i = 0; i < 8; i++) partial[warp][lane * 8 + i] = sum[i];
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < 8; w++) total += partial[w][threadIdx.x];
    mean[h * HEAD_DIM + threadIdx.x] = total / n;
}

// Eight values into 8-bit codes of `inv` (127 / max |x| of the row, 0 for a row of zeros), low byte first.
__device__ __forceinline__ uint2 codes8(const float (&x)[8], float inv) {
    u32 w[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int c = max(-127, min(127, __float2int_rn(x[i] * inv)));
        w[i / 4] |= ((u32)c & 0xffu) << (8 * (i % 4));
    }
    return make_uint2(w[0], w[1]);
}

// Grid ceil((tokens * N_HEADS + (start + tokens) * N_KV_HEADS) / 8) blocks of 256 threads, a warp a row, a lane 8
// dims: the query rows (token, head) first, then the key rows (position, KV head).
extern "C" __global__ void __launch_bounds__(256)
    attn_prefill_codes(const bf16* q, const bf16* k_pool, const int* pages, const float* mean, int tokens, int start,
                       int scale_stride, i8* q8, float* q_scale, i8* k8, float* k_scale) {
    wait_previous();
    const int lane = threadIdx.x % WARP;
    const long long item = (long long)blockIdx.x * (256 / WARP) + threadIdx.x / WARP;
    const long long q_rows = (long long)tokens * N_HEADS;
    if (item >= q_rows + (long long)(start + tokens) * N_KV_HEADS) return;
    const int d0 = lane * 8;
    float x[8];
    const bf16* src;
    if (item < q_rows) {
        src = q + item * HEAD_DIM + d0;
    } else {
        const int position = (int)((item - q_rows) / N_KV_HEADS), h = (int)((item - q_rows) % N_KV_HEADS);
        src = k_pool + kv_offset(pages, position) + h * HEAD_DIM + d0;
    }
    load8_bf16(src, x);
    if (item >= q_rows) {
        const int h = (int)((item - q_rows) % N_KV_HEADS);
        const float4 a = *(const float4*)(mean + h * HEAD_DIM + d0), b = *(const float4*)(mean + h * HEAD_DIM + d0 + 4);
        x[0] -= a.x, x[1] -= a.y, x[2] -= a.z, x[3] -= a.w, x[4] -= b.x, x[5] -= b.y, x[6] -= b.z, x[7] -= b.w;
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(x[i]));
    amax = warp_max(amax);
    const float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
    const uint2 codes = codes8(x, inv);
    if (item < q_rows) {
        *(uint2*)(q8 + item * HEAD_DIM + d0) = codes;
        if (lane == 0) q_scale[item] = scale;
    } else {
        const long long row = item - q_rows;
        *(uint2*)(k8 + row * HEAD_DIM + d0) = codes;
        if (lane == 0) k_scale[(size_t)(row % N_KV_HEADS) * scale_stride + row / N_KV_HEADS] = scale;
    }
}

// ---- Values in e4m3 for attn_prefill_i8 (ATTN_I8_V8=1: a switch, off by default) ----
// O += P V on e4m3 operands (m64n256k32, twice bf16's rate) with the values coded per (KV head, block of 64
// positions: a key tile) with the block's largest magnitude at 448, and each key tile's probabilities scaled per row
// so that the tile's largest is 448 too (the two scales fold into O's per-row rescaling). It halves the bytes a key
// tile's values copy and the time of their product, at a logit error that bench/RESULTS.md states (the CPU numerics
// study's Operand::E4m3Scaled is the same format); the default keeps the values in bf16.
//
// wgmma takes 8-bit B operands K-major only, so the codes are stored transposed: block b of KV head h is 16 KiB at
// v8 + (h * blocks + b) * 16384, four 4 KiB chunks of 16 key slots, each chunk 256 dims x 16 bytes (a core matrix
// is 8 dims x 16 slots, 128 contiguous bytes). Within each group of 32 keys, key j sits in slot v8_slot(j): the
// order in which a thread's S accumulators already hold P, so that P feeds the A operand from registers unshuffled.
#ifndef ATTN_I8_V8
#define ATTN_I8_V8 0
#endif
// Any value but 0 switches it on; the host reads 1 then (it sizes and passes the codes' buffers by this).
__device__ int attn_prefill_i8_v8 = ATTN_I8_V8 != 0;
// With ATTN_I8_V8 the scales are fixed along a row rather than per key tile (ATTN_I8_V8_ROW, default 1): the values
// have one scale per KV head (attn_prefill_v_max finds the head's largest magnitude before attn_prefill_v_codes codes
// them), and P' = 448 x 2^(s - the row's running maximum). Then P' V' is in the same units on every tile and O is
// rescaled only where a row's maximum moves (the lazy maxima with no slack), which makes the kernel 6% faster than
// with a scale per key tile. On the bundled model the row-fixed scales are as accurate as per-tile ones
// (bench/RESULTS.md). ATTN_I8_V8_ROW=0 keeps a scale per (KV head, block of 64 positions) and the probabilities
// against each tile's maximum, with O rescaled on every tile.
#ifndef ATTN_I8_V8_ROW
#define ATTN_I8_V8_ROW 1
#endif
__device__ int attn_prefill_i8_v8_row = ATTN_I8_V8 != 0 && ATTN_I8_V8_ROW != 0;
#define V8_BLOCK_BYTES (KEY_TILE * HEAD_DIM)     // 16 KiB
#define V8_CHUNK_BYTES (16 * HEAD_DIM)           // 4 KiB: 16 key slots of every dim
#define E4M3_MAX 448.f
// Slot k (0 .. 31) of a 32-key group holds key 16 (k / 16) + 8 (i / 2) + 2 c + i % 2, c = k % 16 / 4, i = k % 4:
// the A fragment's bytes 4 c .. 4 c + 3 (and 16 + ..) are the keys the thread's accumulators hold for row g.
__device__ __forceinline__ int v8_slot(int key32) {
    const int half = key32 / 16, r = key32 % 16, m = r / 8, c = (r % 8) / 2, e = r % 2;
    return 16 * half + 4 * c + 2 * m + e;
}

#if API_BUILT  // e4m3 conversions need sm_89 on
// Two floats as e4m3 (rounded to nearest, saturating), the first in the low byte.
__device__ __forceinline__ unsigned short e4m3x2(float first, float second) {
    unsigned short two;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(second), "f"(first));
    return two;
}
#endif

// Thread i of 256 loads key slot i / 4's 64 dims from (i % 4) * 64 of the values of block blockIdx.x of KV head
// blockIdx.y into x (zero past `positions`) and returns the block's largest magnitude.
__device__ __forceinline__ float v_block_load(const bf16* v_pool, const int* pages, int positions,
                                              float (&x)[HEAD_DIM / 4]) {
    __shared__ float block_max[256 / WARP];
    const int key = threadIdx.x / 4, d0 = (threadIdx.x % 4) * (HEAD_DIM / 4);  // 64 dims a thread
    const int position = blockIdx.x * KEY_TILE + key;
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 4; i += 8) {
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (position < positions) load8_bf16(v_pool + kv_offset(pages, position) + blockIdx.y * HEAD_DIM + d0 + i, v);
#pragma unroll
        for (int j = 0; j < 8; j++) x[i + j] = v[j];
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 4; i++) amax = fmaxf(amax, fabsf(x[i]));
    amax = warp_max(amax);
    if (threadIdx.x % WARP == 0) block_max[threadIdx.x / WARP] = amax;
    __syncthreads();
    amax = 0.f;
#pragma unroll
    for (int w = 0; w < 256 / WARP; w++) amax = fmaxf(amax, block_max[w]);
    return amax;
}

// With ATTN_I8_V8_ROW: grid (blocks of 64 positions, N_KV_HEADS) x 256 threads raise v_max[kv head] (cleared by
// attn_prefill_key_mean) to the largest value magnitude of positions 0 .. positions - 1. A float's bits order
// non-negative floats as unsigned integers do.
extern "C" __global__ void __launch_bounds__(256)
    attn_prefill_v_max(const bf16* v_pool, const int* pages, int positions, float* v_max) {
    wait_previous();
    float x[HEAD_DIM / 4];
    const float amax = v_block_load(v_pool, pages, positions, x);
    if (threadIdx.x == 0) atomicMax((unsigned*)v_max + blockIdx.y, __float_as_uint(amax));
}

// Grid (blocks of 64 positions, N_KV_HEADS) x 256 threads: the values of positions 0 .. positions - 1 as e4m3
// codes and one scale per (KV head, block) into v8 and v_scale ([kv head][scale_stride / 64]); positions past the
// end of the last block read as zero. The scale puts the block's largest magnitude at 448, or where v_max is not
// null (ATTN_I8_V8_ROW) the KV head's largest (v_max[kv head]), so that every block of a head has the same scale.
extern "C" __global__ void __launch_bounds__(256)
    attn_prefill_v_codes(const bf16* v_pool, const int* pages, int positions, int scale_stride,
                         const float* v_max, u8* v8, float* v_scale) {
    wait_previous();
#if API_BUILT  // e4m3 conversions need sm_89 on; the host launches it only where attn_prefill_i8 is built
    __shared__ __align__(16) unsigned char tile[V8_BLOCK_BYTES];
    const int block = blockIdx.x, h = blockIdx.y, blocks = scale_stride / KEY_TILE;
    const int key = threadIdx.x / 4, d0 = (threadIdx.x % 4) * (HEAD_DIM / 4);
    float x[HEAD_DIM / 4];
    float amax = v_block_load(v_pool, pages, positions, x);
    if (v_max) amax = v_max[h];
    // A block of zeros gets a small positive scale: the attention divides by it.
    const float scale = fmaxf(amax / E4M3_MAX, 1e-20f), inv = 1.f / scale;
    const int slot = v8_slot(key % 32), chunk = 2 * (key / 32) + slot / 16;
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 4; i += 2) {
        const unsigned short two = e4m3x2(x[i] * inv, x[i + 1] * inv);
        tile[chunk * V8_CHUNK_BYTES + (d0 + i) * 16 + slot % 16] = (unsigned char)(two & 0xff);
        tile[chunk * V8_CHUNK_BYTES + (d0 + i + 1) * 16 + slot % 16] = (unsigned char)(two >> 8);
    }
    __syncthreads();
    uint4* dst = (uint4*)(v8 + ((size_t)h * blocks + block) * V8_BLOCK_BYTES);
#pragma unroll
    for (int i = 0; i < V8_BLOCK_BYTES / 16 / 256; i++)
        dst[threadIdx.x + 256 * i] = ((const uint4*)tile)[threadIdx.x + 256 * i];
    if (threadIdx.x == 0) v_scale[(size_t)h * blocks + block] = scale;
#else
    __trap();
#endif
}

#if API_BUILT
// d += A (64 x 32 e4m3, registers: the mma.sync m16n8k32 A fragment of each warp's 16 rows) B (32 x 256 e4m3,
// shared, K-major without swizzle: 16-slot core matrices 4,096 bytes apart along the keys, 8-dim groups 128 bytes
// apart): 128 f32.
__device__ __forceinline__ void api_m64n256k32_e4m3(float (&d)[128], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {"
        APW_O128_REGS
        "}, {%128, %129, %130, %131}, %132, p, 1, 1;\n}\n"
        : APW_O128
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
// The descriptor of 32 key slots x 256 dims of a value-code block at `addr` (no swizzle: LBO the next 16 slots,
// SBO the next 8 dims).
__device__ __forceinline__ u64 api_v8_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(V8_CHUNK_BYTES >> 4) << 16) | ((u64)(128 >> 4) << 32);
}
// Four floats as e4m3 in one register, the first in the lowest byte.
__device__ __forceinline__ u32 pack_e4m3x4(float a, float b, float c, float d) {
    return (u32)e4m3x2(a, b) | ((u32)e4m3x2(c, d) << 16);
}
#endif

#if API_BUILT
// s = A (64 x 32 codes, shared) B (64 x 32 codes, shared)^T (+ s unless scale_d is 0): 32 s32 a thread, in the
// f32 accumulators' layout.
#define API_D8(i) "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3]), "+r"(d[i + 4]), "+r"(d[i + 5]), \
                  "+r"(d[i + 6]), "+r"(d[i + 7])
__device__ __forceinline__ void api_m64n64k32(int (&d)[32], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
        "}, %32, %33, p;\n}\n"
        : API_D8(0), API_D8(8), API_D8(16), API_D8(24)
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
#undef API_D8
// An s32 below 2^22 in magnitude as f32, exactly: added to the bits of 1.5 * 2^23 it lands in that float's
// mantissa, and subtracting 1.5 * 2^23 leaves it (two full-rate operations instead of a quarter-rate I2F).
__device__ __forceinline__ float api_to_float(int s) { return __int_as_float(s + 0x4B400000) - 12582912.f; }
#endif

// ---- The warpgroup kernels' shared body ----
// attn_prefill_wgmma and attn_prefill_i8 are one loop (apw_attention) over a score product, given as a class:
// ApwBf16Scores (S on bf16 Q and keys, m64n64k16) or ApwI8Scores (S on 8-bit codes, m64n64k32, and their
// scales). The class copies Q and the key tiles, issues S = Q K^T for a tile and turns the accumulators into the
// scores the softmax reads; the loop owns the pipeline, the mask, the online softmax, O += P V and the epilogue.
// Shared memory: Q (Q_BYTES), three key tiles (K_BYTES each), two value tiles (32 KiB each), then what the class
// keeps beside them (the i8 key tiles' scales).
#if APW_BUILT
// Value or key tile `tile` of the chunk (keys key_begin + KEY_TILE * tile ..: one page) from `pool` into the
// 32 KiB buffer at `buf`; keys past key_end read as zero. Thread i copies chunk i % 32 of rows i / 32 + 8 j,
// which lie 1,024 bytes apart in the buffer (rows 8 apart share their swizzle).
__device__ __forceinline__ void apw_load_tile(const bf16* pool, const int* pages, u32 buf, int tile, int key_begin,
                                              int key_end, int kv_head) {
    const int copy_row = threadIdx.x / ROW_CHUNKS, copy_chunk = threadIdx.x % ROW_CHUNKS;
    const u32 copy_dst = apw_at<KEY_TILE>(copy_row, copy_chunk);
    const int key0 = key_begin + tile * KEY_TILE;
    const bf16* src = pool + (size_t)pages[key0 / KV_PAGE] * KV_PAGE * KV_DIM + kv_head * HEAD_DIM + copy_chunk * 8;
#pragma unroll
    for (int j = 0; j < KEY_TILE / 8; j++) {
        const int row = copy_row + 8 * j;
        const bool valid = key0 + row < key_end;
        cp_async_16(buf + copy_dst + j * 1024, src + (size_t)(valid ? row : 0) * KV_DIM, valid ? 16u : 0u);
    }
}

// The block's Q rows (row = head of the group x QUERY_TILE + token) of bf16 values or 8-bit codes into the Q tile at
// `q_smem`, 16-byte chunks in the operand layout; tokens past the end read as zero.
template <class T>
__device__ __forceinline__ void apw_load_q(const T* q, u32 q_smem, int tok0, int tokens, int kv_head) {
    constexpr int CHUNKS = HEAD_DIM * (int)sizeof(T) / 16, PER_CHUNK = 16 / (int)sizeof(T);
#pragma unroll
    for (int i = 0; i < APW_ROWS * CHUNKS / PF_THREADS; i++) {
        const int c = threadIdx.x + i * PF_THREADS;
        const int row = c / CHUNKS, chunk16 = c % CHUNKS;
        const int token = tok0 + row % QUERY_TILE;
        const bool valid = token < tokens;
        const T* src = q + ((size_t)(valid ? token : tok0) * N_HEADS + kv_head * GQA + row / QUERY_TILE) * HEAD_DIM;
        cp_async_16(q_smem + apw_at<APW_ROWS>(row, chunk16), src + chunk16 * PER_CHUNK, valid ? 16u : 0u);
    }
}

// Lazy maxima. ATTN_LAZY is a mask: the int8 kernel with bf16 values (bit 0) and the bf16 kernel (bit 1) keep a
// row's maximum until a tile's exceeds it by more than ATTN_RESCALE_SLACK (log2 units), and a warp rescales O only
// when one of its rows moved. Every other tile then goes from the softmax's last exponential to its O += P V without
// 128 multiplications a thread, which lie on the path between two tiles' products now that the softmax overlaps the
// product before. The probabilities reach 2^SLACK, which bf16 and the f32 sums hold. The e4m3 values take the lazy
// maxima with no slack where their scales are fixed along a row (ATTN_I8_V8_ROW, below), whatever this mask says,
// and never with a scale per tile, whose O is rescaled every tile. 0 rescales every tile.
#ifndef ATTN_LAZY
#define ATTN_LAZY 3
#endif
#ifndef ATTN_RESCALE_SLACK
#define ATTN_RESCALE_SLACK 8.f
#endif

// S on bf16 operands: Q (16 chunks a thread) and the key tiles as copied, sixteen k16 steps over the 256 dims. The
// scores come out in natural units; the softmax scales them by LOG2E as it reads them.
struct ApwBf16Scores {
    using Acc = float;
    static constexpr bool V8 = false;  // the values stay bf16
    static constexpr bool ROW = false;
    static constexpr bool LAZY = (ATTN_LAZY & 2) != 0;
    static constexpr u32 Q_BYTES = APW_Q_BYTES, K_BYTES = APW_KV_BYTES;
    const bf16* q;
    const bf16* k_pool;
    const int* pages;

    __device__ __forceinline__ void bind(const unsigned char*, u32, u32) {}
    // What turns row r's scores into log2 units.
    __device__ __forceinline__ float log2_scale(int) const { return LOG2E; }
    __device__ __forceinline__ float value_scale(int, int) const { return 1.f; }
    __device__ __forceinline__ void load_q(u32 q_smem, int tok0, int tokens, int kv_head) const {
        apw_load_q(q, q_smem, tok0, tokens, kv_head);
    }
    __device__ __forceinline__ void load_keys(u32 k_smem, int buf, int tile, int key_begin, int key_end,
                                              int kv_head) const {
        apw_load_tile(k_pool, pages, k_smem + buf * K_BYTES, tile, key_begin, key_end, kv_head);
    }
    __device__ __forceinline__ void rows(int, int, int, int) {}
    __device__ __forceinline__ void issue(float (&s)[32], u32 q_wg, u32 k_tile) const {
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ks++) {
            const u32 kb = ks / 4, step = 32 * (ks % 4);
            apw_m64n64k16(s, wgmma_desc(q_wg + kb * APW_ROWS * 128 + step),
                          wgmma_desc(k_tile + kb * KEY_TILE * 128 + step), ks > 0);
        }
    }
    __device__ __forceinline__ void scores(const float (&s)[32], float (&x)[32], int, int) const {
#pragma unroll
        for (int i = 0; i < 32; i++) x[i] = s[i];
    }
};

// S on 8-bit codes: Q codes (8 chunks a thread) and key tiles of codes with their scales, eight k32 steps. The
// scores come out as code sum x k scale; the softmax multiplies them by the row's q scale (holding LOG2E) in the
// exponential's multiply-add, which saves a multiplication a score (the q scale is positive, so it commutes with
// the row's maximum).
struct ApwI8Scores {
    using Acc = int;
    static constexpr bool V8 = ATTN_I8_V8 != 0;
    static constexpr bool ROW = V8 && ATTN_I8_V8_ROW != 0;
    static constexpr bool LAZY = (!V8 && (ATTN_LAZY & 1) != 0) || ROW;
    static constexpr u32 Q_BYTES = API_Q_BYTES, K_BYTES = API_K_BYTES;
    const i8* q8;
    const float* q_scale;
    const i8* k8;
    const float* k_scale;
    int scale_stride;
    const u8* v8;  // with V8: the value codes and their scales (attn_prefill_v_codes)
    const float* v_scale;
    u32 ks_smem;  // three tiles' key scales, after the value tiles
    const float* ks_base;
    float q_log2[2];

    __device__ __forceinline__ void bind(const unsigned char* smem_raw, u32 raw0, u32 after_values) {
        ks_smem = after_values;
        ks_base = (const float*)(smem_raw + (ks_smem - raw0));
    }
    __device__ __forceinline__ float log2_scale(int r) const { return q_log2[r]; }
    // With V8: the index of the value codes' block (and scale) of KV head kv_head from key key0 on.
    __device__ __forceinline__ size_t value_block(int key0, int kv_head) const {
        return (size_t)kv_head * (scale_stride / KEY_TILE) + key0 / KEY_TILE;
    }
    // The value codes of the key tile from key key0 on (a block of 64 positions) into the V buffer at `buf`.
    __device__ __forceinline__ void load_values8(u32 buf, int key0, int kv_head) const {
        const unsigned char* src = v8 + value_block(key0, kv_head) * V8_BLOCK_BYTES;
#pragma unroll
        for (int i = 0; i < V8_BLOCK_BYTES / 16 / PF_THREADS; i++) {
            const int at = 16 * ((int)threadIdx.x + PF_THREADS * i);
            cp_async_16(buf + at, src + at, 16u);
        }
    }
    __device__ __forceinline__ float value_scale(int key0, int kv_head) const {
        return V8 ? v_scale[value_block(key0, kv_head)] : 1.f;
    }
    __device__ __forceinline__ void load_q(u32 q_smem, int tok0, int tokens, int kv_head) const {
        apw_load_q(q8, q_smem, tok0, tokens, kv_head);
    }
    // Key tile `tile` (codes and scales) into K buffer `buf`: thread i copies chunk i % 16 of rows i / 16 + 16 j,
    // 2,048 bytes apart in the buffer (rows 16 apart share their swizzle); threads 0 .. 15 copy the 64 scales.
    // Keys past key_end read as zero codes; their scales are whatever lies there (their scores are masked).
    __device__ __forceinline__ void load_keys(u32 k_smem, int buf, int tile, int key_begin, int key_end,
                                              int kv_head) const {
        const int kc_row = threadIdx.x / API_ROW_CHUNKS, kc_chunk = threadIdx.x % API_ROW_CHUNKS;
        const int key0 = key_begin + tile * KEY_TILE;
        const u32 dst = k_smem + buf * API_K_BYTES + apw_at<KEY_TILE>(kc_row, kc_chunk);
#pragma unroll
        for (int j = 0; j < KEY_TILE / 16; j++) {
            const int key = key0 + kc_row + 16 * j;
            const bool valid = key < key_end;
            const i8* src = k8 + ((size_t)(valid ? key : key0) * N_KV_HEADS + kv_head) * HEAD_DIM + kc_chunk * 16;
            cp_async_16(dst + j * 2048, src, valid ? 16u : 0u);
        }
        if (threadIdx.x < KEY_TILE / 4)
            cp_async_16(ks_smem + (buf * KEY_TILE + 4 * threadIdx.x) * 4,
                        k_scale + (size_t)kv_head * scale_stride + key0 + 4 * threadIdx.x, 16u);
    }
    // The thread's rows' query scales in log2 units; rows past the end read token tok0's. A row of zero codes
    // (scale 0) gets a tiny positive scale instead, so that a masked score (-inf) times it stays -inf.
    __device__ __forceinline__ void rows(int tok0, int tokens, int head, int g) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int token = tok0 + g + 8 * r;
            q_log2[r] = fmaxf(q_scale[(size_t)(token < tokens ? token : tok0) * N_HEADS + head] * LOG2E, 1e-30f);
        }
    }
    __device__ __forceinline__ void issue(int (&s)[32], u32 q_wg, u32 k_tile) const {
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 32; ks++) {
            const u32 kb = ks / 4, step = 32 * (ks % 4);
            api_m64n64k32(s, wgmma_desc(q_wg + kb * APW_ROWS * 128 + step),
                          wgmma_desc(k_tile + kb * KEY_TILE * 128 + step), ks > 0);
        }
    }
    // Accumulator j of the n8 block n is row g + 8 (j / 2), key 8 n + 2 c + j % 2 of the tile in K buffer `buf`.
    __device__ __forceinline__ void scores(const int (&s)[32], float (&x)[32], int buf, int c) const {
        const float* k_scales = ks_base + buf * KEY_TILE;
#pragma unroll
        for (int n = 0; n < KEY_TILE / 8; n++) {
            const float2 kk = *(const float2*)(k_scales + 8 * n + 2 * c);
            x[4 * n] = api_to_float(s[4 * n]) * kk.x;
            x[4 * n + 1] = api_to_float(s[4 * n + 1]) * kk.y;
            x[4 * n + 2] = api_to_float(s[4 * n + 2]) * kk.x;
            x[4 * n + 3] = api_to_float(s[4 * n + 3]) * kk.y;
        }
    }
};

// O += P V of one key tile: P as bf16 A fragments (four k16 steps) over the bf16 value tile as copied, or with V8
// as e4m3 A fragments (two k32 steps, p[0] and p[1]) over the tile's value codes.
template <bool V8>
__device__ __forceinline__ void apw_add_pv(float (&o)[128], const u32 (&p)[KEY_TILE / 16][4], u32 v_tile) {
    if constexpr (V8) {
#pragma unroll
        for (int j = 0; j < KEY_TILE / 32; j++)
            api_m64n256k32_e4m3(o, p[j], api_v8_desc(v_tile + 2 * j * V8_CHUNK_BYTES));
    } else {
#pragma unroll
        for (int j = 0; j < KEY_TILE / 16; j++) apw_m64n256k16_rs_t(o, p[j], apw_v_desc(v_tile + 2048 * j));
    }
}
// P (the accumulators' layout: x[4 n + e] row g, x[4 n + 2 + e] row g + 8, key 8 n + 2 c + e) as A fragments. bf16:
// keys 16 j .. 16 j + 15 in p[j]. e4m3: keys 32 j .. 32 j + 31 in p[j], bytes in the slot order of v8_slot (p[j][0]
// row g's keys 2 c, 2 c + 1, 8 + 2 c, 9 + 2 c of the group; p[j][2] the same 16 keys on; [1] and [3] row g + 8).
template <bool V8>
__device__ __forceinline__ void apw_pack_p(u32 (&p)[KEY_TILE / 16][4], const float (&x)[32]) {
    if constexpr (V8) {
#pragma unroll
        for (int j = 0; j < KEY_TILE / 32; j++) {
            const float* y = x + 16 * j;
            p[j][0] = pack_e4m3x4(y[0], y[1], y[4], y[5]);
            p[j][1] = pack_e4m3x4(y[2], y[3], y[6], y[7]);
            p[j][2] = pack_e4m3x4(y[8], y[9], y[12], y[13]);
            p[j][3] = pack_e4m3x4(y[10], y[11], y[14], y[15]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < KEY_TILE / 16; j++) {
            p[j][0] = pack_bf16x2(x[8 * j], x[8 * j + 1]);
            p[j][1] = pack_bf16x2(x[8 * j + 2], x[8 * j + 3]);
            p[j][2] = pack_bf16x2(x[8 * j + 4], x[8 * j + 5]);
            p[j][3] = pack_bf16x2(x[8 * j + 6], x[8 * j + 7]);
        }
    }
}

// The body of both kernels (grid and ownership as attn_prefill_wgmma's header says), `smem_raw` the kernel's
// dynamic shared memory.
template <class Scores>
__device__ __forceinline__ void apw_attention(Scores sc, unsigned char* smem_raw, const bf16* v_pool,
                                              const int* pages, const float* proj, int tokens, int start, int chunk,
                                              bf16* out, float* part_o, float* part_ml) {
    const u32 raw0 = shared_address(smem_raw), q_smem = (raw0 + 1023) & ~1023u;
    const u32 k_smem = q_smem + Scores::Q_BYTES;  // three key tiles
    const u32 v_smem = k_smem + 3 * Scores::K_BYTES;  // two value tiles
    sc.bind(smem_raw, raw0, v_smem + 2 * APW_KV_BYTES);
    const int tiles = (tokens + QUERY_TILE - 1) / QUERY_TILE;
    const int kv_head = blockIdx.x % N_KV_HEADS;
    const int tok0 = (tiles - 1 - (int)blockIdx.x / N_KV_HEADS) * QUERY_TILE;
    const int key_begin = blockIdx.y * chunk;
    const int key_end = min(key_begin + chunk, start + min(tok0 + QUERY_TILE, tokens));
    if (key_begin >= key_end) return;
    const int key_tiles = (key_end - key_begin + KEY_TILE - 1) / KEY_TILE;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, wg = warp / 4;
    const int head = kv_head * GQA + warp;

    // Copy groups: (Q, key tile 0), (key tile 1), then in iteration it (value tile it), (key tile it + 2). Key tile
    // it goes to K buffer it % 3, value tile it to V buffer it % 2.
    sc.load_q(q_smem, tok0, tokens, kv_head);
    sc.load_keys(k_smem, 0, 0, key_begin, key_end, kv_head);
    cp_async_commit();
    if (key_tiles > 1) sc.load_keys(k_smem, 1, 1, key_begin, key_end, kv_head);
    cp_async_commit();

    const int g = lane / 4, c = lane % 4;
    const int limit0 = min(start + tok0 + g, key_end - 1), limit1 = min(start + tok0 + g + 8, key_end - 1);
    const int first_masked_from = min(start + tok0, key_end - 1);
    sc.rows(tok0, tokens, head, g);

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.f;
    float row_max[2] = {-INF_F, -INF_F};  // log2 units
    float row_sum[2] = {0.f, 0.f};        // this lane's columns only; the quad's sum at the end
    float o_div[2] = {1.f, 1.f};          // with V8: what O is held divided by
    // With ROW every key tile of the head has the head's value scale, in which O is held (times 1 / 448).
    if constexpr (Scores::ROW) o_div[0] = o_div[1] = sc.value_scale(key_begin, kv_head) * (1.f / E4M3_MAX);
    const u32 q_wg = q_smem + wg * 64 * 128;
    // P of the tile before as A fragments: keys 16 j .. 16 j + 15 are the n8 blocks 2 j (k 0..7) and 2 j + 1.
    u32 p[KEY_TILE / 16][4];

    // Iteration it issues S = Q K^T for key tile it and then O += P V for tile it - 1, so the tensor cores work on
    // the second while the softmax of the first runs; O is rescaled once the second is done.
    for (int it = 0; it < key_tiles; it++) {
        const int key0 = key_begin + it * KEY_TILE;
        cp_async_wait<1>();  // Q, key tile it and value tile it - 1 (this thread's copies; key tile it + 1 may fly)
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();  // ... everyone's; every warpgroup is done with key tile it - 1 and value tile it - 2
        if constexpr (Scores::V8)
            sc.load_values8(v_smem + (it % 2) * APW_KV_BYTES, key0, kv_head);
        else
            apw_load_tile(v_pool, pages, v_smem + (it % 2) * APW_KV_BYTES, it, key_begin, key_end, kv_head);
        cp_async_commit();
        const float value_scale = sc.value_scale(key0, kv_head);  // with V8: tile it's values' scale
        if (it + 2 < key_tiles) sc.load_keys(k_smem, (it + 2) % 3, it + 2, key_begin, key_end, kv_head);
        cp_async_commit();

        typename Scores::Acc s[32];
#pragma unroll
        for (int i = 0; i < 32; i++) s[i] = 0;
        const u32 k_tile = k_smem + (it % 3) * Scores::K_BYTES;
        wgmma_fence();
        sc.issue(s, q_wg, k_tile);
        wgmma_commit();
        if (it > 0) {
            const u32 v_tile = v_smem + ((it - 1) % 2) * APW_KV_BYTES;
            apw_add_pv<Scores::V8>(o, p, v_tile);
            wgmma_commit();
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
        }
        wgmma_hold(s);

        // Accumulator j of the n8 block n: row g + 8 (j / 2), key 8 n + 2 c + j % 2 (as mma.sync's).
        float x[32];
        sc.scores(s, x, it % 3, c);
        if (key0 + KEY_TILE - 1 > first_masked_from) {
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++) {
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = key0 + n * 8 + 2 * c + e;
                    if (key > limit0) x[4 * n + e] = -INF_F;
                    if (key > limit1) x[4 * n + 2 + e] = -INF_F;
                }
            }
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float m = -INF_F;
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++) m = fmaxf(m, fmaxf(x[4 * n + 2 * r], x[4 * n + 2 * r + 1]));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            const float scale = sc.log2_scale(r);
            const float tile_max = m * scale;
            // Lazily (ATTN_LAZY): the row keeps its maximum unless the tile's exceeds it by more than the slack.
            const float slack = Scores::ROW ? 0.f : ATTN_RESCALE_SLACK;  // e4m3's P' may not pass 448
            const float moved = tile_max > row_max[r] + slack ? tile_max : row_max[r];
            const float new_max = Scores::LAZY ? moved : fmaxf(row_max[r], tile_max);
            const float base = new_max == -INF_F ? 0.f : new_max;  // a row that has seen only masked keys
            alpha[r] = exp2_approx(row_max[r] - base);
            row_max[r] = new_max;
            // With V8 the tile's probabilities are taken against their own maximum (at most 2^16 below the row's)
            // and scaled so that it is 448, e4m3's largest: P' = P x 448 / 2^(tile max - row max).
            const float exp_base = Scores::ROW  ? base - 8.807354922f  // log2(448)
                                   : Scores::V8 ? fmaxf(tile_max, base - 16.f) - 8.807354922f
                                                : base;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < KEY_TILE / 8; n++) {
                x[4 * n + 2 * r] = exp2_approx(fmaf(x[4 * n + 2 * r], scale, -exp_base));
                x[4 * n + 2 * r + 1] = exp2_approx(fmaf(x[4 * n + 2 * r + 1], scale, -exp_base));
                sum += x[4 * n + 2 * r] + x[4 * n + 2 * r + 1];
            }
            if constexpr (Scores::ROW) {
                // P = P' / 448; O is held divided by the head's value scale / 448 throughout.
                row_sum[r] = row_sum[r] * alpha[r] + sum * (1.f / E4M3_MAX);
            } else if constexpr (Scores::V8) {
                // P = P' x to_true; O is held divided by f (to_true x the values' scale, as of the last tile), so
                // its rescaling before this tile's product is alpha x f_before / f.
                const float to_true = exp2_approx(exp_base - base), f = to_true * value_scale;
                row_sum[r] = row_sum[r] * alpha[r] + sum * to_true;
                alpha[r] = alpha[r] * __fdividef(o_div[r], f);
                o_div[r] = f;
            } else {
                row_sum[r] = row_sum[r] * alpha[r] + sum;
            }
        }
        // The softmax is done before the wait for O += P V below, so that the two overlap. In straight-line code
        // ptxas hoists that wait above the softmax (to start O's rescaling early), which serializes them; a wait
        // inside a block behind a branch it cannot resolve stays where it is written. Every block that gets here
        // has tokens > 0.
        wgmma_hold(x);
        wgmma_hold(alpha);
        if (tokens > 0) {
            // O += P V of the tile before is done: O and P are free again.
            wgmma_wait<0>();
            wgmma_hold(o);
            apw_hold(p);
            // Lazily, only a warp one of whose rows moved its maximum rescales (a vote keeps the branch uniform).
            if (!Scores::LAZY || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 8; n++) {
                    o[4 * n] *= alpha[0], o[4 * n + 1] *= alpha[0];
                    o[4 * n + 2] *= alpha[1], o[4 * n + 3] *= alpha[1];
                }
            }
            apw_pack_p<Scores::V8>(p, x);
        }
    }
    // O += P V of the last tile, once its values have landed for every thread.
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    {
        const u32 v_tile = v_smem + ((key_tiles - 1) % 2) * APW_KV_BYTES;
        wgmma_fence();
        wgmma_hold(o);
        apw_add_pv<Scores::V8>(o, p, v_tile);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_hold(o);
    }
    if constexpr (Scores::V8) {
#pragma unroll
        for (int n = 0; n < HEAD_DIM / 8; n++) {
            o[4 * n] *= o_div[0], o[4 * n + 1] *= o_div[0];
            o[4 * n + 2] *= o_div[1], o[4 * n + 3] *= o_div[1];
        }
    }
    attn_prefill_store(o, row_max, row_sum, tok0, tokens, head, g, c, proj, out, part_o, part_ml);
}
#endif

// APW_SMEM bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(PF_THREADS, 1)
    attn_prefill_wgmma(const bf16* q, const bf16* k_pool, const bf16* v_pool, const int* pages, const float* proj,
                       int tokens, int start, int chunk, bf16* out, float* part_o, float* part_ml) {
    wait_previous();
#if APW_BUILT
    extern __shared__ __align__(128) unsigned char smem_raw[];
    apw_attention(ApwBf16Scores{q, k_pool, pages}, smem_raw, v_pool, pages, proj, tokens, start, chunk, out, part_o,
                  part_ml);
#else
    __trap();  // built without it: the host never launches it (attn_prefill_wgmma_built is 0)
#endif
}

// Grid, outputs and per-row ownership as attn_prefill_wgmma; API_SMEM bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(PF_THREADS, 1)
    attn_prefill_i8(const i8* q8, const float* q_scale, const i8* k8, const float* k_scale, int scale_stride,
                    const u8* v8, const float* v_scale, const bf16* v_pool, const int* pages,
                    const float* proj, int tokens, int start, int chunk, bf16* out, float* part_o, float* part_ml) {
    wait_previous();
#if API_BUILT
    extern __shared__ __align__(128) unsigned char smem_raw[];
    ApwI8Scores scores{q8, q_scale, k8, k_scale, scale_stride, v8, v_scale};
    apw_attention(scores, smem_raw, v_pool, pages, proj, tokens, start, chunk, out, part_o, part_ml);
#else
    __trap();  // built without it: the host never launches it (attn_prefill_i8_built is 0)
#endif
}

// Grid ceil(tokens * N_HEADS / 8) blocks of 256 threads, one warp per (token, query head), a lane holding 8 dims:
// combines the chunks attn_prefill wrote for the token's query tile and applies the gate.
extern "C" __global__ void __launch_bounds__(256)
    attn_prefill_merge(const float* part_o, const float* part_ml, const float* proj, int tokens, int start, int chunk,
                       bf16* out) {
    wait_previous();
    const int lane = threadIdx.x % WARP;
    const int item = blockIdx.x * (256 / WARP) + threadIdx.x / WARP;
    if (item >= tokens * N_HEADS) return;
    const int token = item / N_HEADS, head = item % N_HEADS;
    const int tile_end = start + min((token / QUERY_TILE + 1) * QUERY_TILE, tokens);
    const int parts = (tile_end + chunk - 1) / chunk;
    const int d0 = lane * 8;
    float mx = -INF_F;  // finite: every token sees key 0, in part 0
    for (int s = 0; s < parts; s++) mx = fmaxf(mx, part_ml[(((size_t)s * tokens + token) * N_HEADS + head) * 2]);
    float num[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, den = 0.f;
    for (int s = 0; s < parts; s++) {
        const size_t part = ((size_t)s * tokens + token) * N_HEADS + head;
        const float2 ml = *(const float2*)(part_ml + part * 2);
        const float w = exp2f(ml.x - mx);
        float o[8];
        load8(part_o + part * HEAD_DIM + d0, o);
        den += w * ml.y;
#pragma unroll
        for (int i = 0; i < 8; i++) num[i] += w * o[i];
    }
    float gate[8];
    load8(proj + (size_t)token * PROJ_ROW + head * 2 * HEAD_DIM + HEAD_DIM + d0, gate);
    float y[8];
#pragma unroll
    for (int i = 0; i < 8; i++) y[i] = num[i] / den * sigmoidf_(gate[i]);
    store8_bf16(out + (size_t)token * Q_DIM + head * HEAD_DIM + d0, y);
}
