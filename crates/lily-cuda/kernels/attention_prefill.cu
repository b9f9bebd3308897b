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
        cp_async_16(q_smem + swizzled(row, chunk16), src + chunk16 * 8, valid);
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
            cp_async_16(dst + swizzled(row, chunk16), src + chunk16 * 8, valid);
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
                *(u32*)(dst + d) = pack_bf16x2(o[n][2 * r] * inv_sum * sigmoidf_(gt.x),
                                               o[n][2 * r + 1] * inv_sum * sigmoidf_(gt.y));
            }
        } else {
            const size_t part = ((size_t)blockIdx.y * tokens + token) * N_HEADS + head;
            float* dst = part_o + part * HEAD_DIM;
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 8; n++)
                *(float2*)(dst + n * 8 + 2 * c) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
            if (c == 0) *(float2*)(part_ml + part * 2) = make_float2(row_max[r], row_sum[r]);
        }
    }
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
