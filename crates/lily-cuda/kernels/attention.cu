// Gated full attention, decode: q/k norms and partial RoPE with the cache write; flash-decoding over the context
// split in ATTN_SPLITS parts per KV head (the GQA query heads of a KV head read each key and value once); the
// merge of the parts with the output gate applied.
//
// KV: bf16 pools per layer for keys and for values, [page][KV_PAGE][kv head][HEAD_DIM]; the page table holds
// pages_per_seq page ids a slot (see kv_offset in common.cuh).
//
// Batched: blockIdx.z is the batch row b, a token of the sequence in slot slots[b] at position positions[b]. Its
// rows: proj + b * PROJ_ROW, q + b * Q_DIM, part_o + b * N_HEADS * ATTN_SPLITS * HEAD_DIM, part_ml + b * N_HEADS *
// ATTN_SPLITS * 2, the output + b * Q_DIM.

#define GQA (N_HEADS / N_KV_HEADS)
#define ATTN_THREADS 256
#define ATTN_WARPS (ATTN_THREADS / WARP)
#define ATTN_TILE 256       // positions scored at once by a block
#define ATTN_MIN_CHUNK 64   // fewest positions a part takes
static_assert(HEAD_DIM == ATTN_THREADS, "one thread per head dimension");
static_assert(GQA == 8, "the score loop holds the 8 query heads of a KV head");
#define PROJ_ROW (2 * Q_DIM + 2 * KV_DIM)
#define PART_O_ROW ((size_t)N_HEADS * ATTN_SPLITS * HEAD_DIM)
#define PART_ML_ROW ((size_t)N_HEADS * ATTN_SPLITS * 2)
// Pages a tile of ATTN_TILE positions starting anywhere touches at most.
#define TILE_PAGES (ATTN_TILE / KV_PAGE + 1)

// Positions per part for a context of `len` split in at most `splits` (<= ATTN_SPLITS) parts; the same in the
// partial and the merge kernels. A batched step with many rows uses fewer parts than one sequence alone: its rows
// already fill the GPU, and every part costs a block.
// A part is whole pages (a multiple of KV_PAGE positions), so that attn_partial_rows's tiles are pages.
__device__ __forceinline__ int attn_chunk(int len, int splits) {
    int c = (len + splits - 1) / splits;
    c = (c + KV_PAGE - 1) / KV_PAGE * KV_PAGE;
    return c < ATTN_MIN_CHUNK ? ATTN_MIN_CHUNK : c;
}

// Grid (N_HEADS + N_KV_HEADS, 1, rows). Blocks 0..N_HEADS: query heads (rmsnorm, RoPE, scaled by 1/sqrt(HEAD_DIM))
// into q_out; then KV heads: key (rmsnorm, RoPE) and value into the pools at the row's position through its slot's
// page-table row. proj: [q|gate per head (2 Q_DIM) | k | v].
extern "C" __global__ void __launch_bounds__(HEAD_DIM) attn_prep(const int* positions, const int* slots,
                                                                 const float* proj, const float* q_norm,
                                                                 const float* k_norm, const float* inv_freq,
                                                                 float* q_out, bf16* k_pool, bf16* v_pool,
                                                                 const int* page_table, int pages_per_seq) {
    __shared__ float x[HEAD_DIM];
    __shared__ float scratch[32];
    // The positions, slots and page table are not written by this step's kernels: read before the wait.
    const int row = blockIdx.z;
    const int position = positions[row];
    proj += (size_t)row * PROJ_ROW;
    q_out += (size_t)row * Q_DIM;
    const int d = threadIdx.x;
    const bool is_query = blockIdx.x < N_HEADS;
    const int kv_head = blockIdx.x - N_HEADS;
    const size_t at = is_query ? 0 : kv_offset(page_table + (size_t)slots[row] * pages_per_seq, position) +
                                         kv_head * HEAD_DIM + d;
    wait_previous();
    const float raw = is_query ? proj[blockIdx.x * 2 * HEAD_DIM + d] : proj[2 * Q_DIM + kv_head * HEAD_DIM + d];
    const float inv = 1.f / sqrtf(block_sum(raw * raw, scratch) / HEAD_DIM + RMS_EPS);
    x[d] = raw * inv * (is_query ? q_norm[d] : k_norm[d]);
    __syncthreads();
    float y = x[d];
    constexpr int HALF = ROT_DIM / 2;
    if (d < ROT_DIM) {
        const int i = d % HALF;
        float sn, cs;
        sincosf((float)position * inv_freq[i], &sn, &cs);
        y = d < HALF ? x[d] * cs - x[d + HALF] * sn : x[d] * cs + x[d - HALF] * sn;
    }
    if (is_query) {
        q_out[blockIdx.x * HEAD_DIM + d] = y * (1.f / sqrtf((float)HEAD_DIM));
    } else {
        k_pool[at] = float_to_bf16(y);
        v_pool[at] = float_to_bf16(proj[2 * Q_DIM + KV_DIM + kv_head * HEAD_DIM + d]);
    }
}

// Scores of the GQA query heads against key rows. The query sits in shared memory as [dim][head] with 16 bytes of
// padding after every 8-dimension piece (see score_quartered). Even and odd dimensions go to separate sums: half
// as long a chain of dependent FMAs.
__device__ __forceinline__ int q_at(int d) { return d * GQA + (d >> 3) * 4; }

// s[h] and s_odd[h] += the key's 8-dimension piece `raw` (dims d0 ..) against query head h.
__device__ __forceinline__ void score_piece(const float* qs, uint4 raw, int d0, float (&s)[GQA], float (&s_odd)[GQA]) {
    const u32 k2[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 kf = pair_to_float2(k2[e]);  // dims d0 + 2e (low) and d0 + 2e + 1 (high)
        const float4* qa = (const float4*)&qs[q_at(d0 + 2 * e)];
        const float4* qb = (const float4*)&qs[q_at(d0 + 2 * e + 1)];
        const float4 a0 = qa[0], a1 = qa[1], b0 = qb[0], b1 = qb[1];
        s[0] = fmaf(kf.x, a0.x, s[0]), s_odd[0] = fmaf(kf.y, b0.x, s_odd[0]);
        s[1] = fmaf(kf.x, a0.y, s[1]), s_odd[1] = fmaf(kf.y, b0.y, s_odd[1]);
        s[2] = fmaf(kf.x, a0.z, s[2]), s_odd[2] = fmaf(kf.y, b0.z, s_odd[2]);
        s[3] = fmaf(kf.x, a0.w, s[3]), s_odd[3] = fmaf(kf.y, b0.w, s_odd[3]);
        s[4] = fmaf(kf.x, a1.x, s[4]), s_odd[4] = fmaf(kf.y, b1.x, s_odd[4]);
        s[5] = fmaf(kf.x, a1.y, s[5]), s_odd[5] = fmaf(kf.y, b1.y, s_odd[5]);
        s[6] = fmaf(kf.x, a1.z, s[6]), s_odd[6] = fmaf(kf.y, b1.z, s_odd[6]);
        s[7] = fmaf(kf.x, a1.w, s[7]), s_odd[7] = fmaf(kf.y, b1.w, s_odd[7]);
    }
}

__device__ __forceinline__ void store_scores(float (&row)[GQA], const float (&s)[GQA], bool in) {
    *(float4*)&row[0] = in ? make_float4(s[0], s[1], s[2], s[3]) : make_float4(-INF_F, -INF_F, -INF_F, -INF_F);
    *(float4*)&row[4] = in ? make_float4(s[4], s[5], s[6], s[7]) : make_float4(-INF_F, -INF_F, -INF_F, -INF_F);
}

// The key row of `pos` (in the tile whose first page is page `page0` of the sequence) for kv_head.
__device__ __forceinline__ const uint4* key_row(const bf16* k_pool, const int* tile_pages, int page0, int pos,
                                                int kv_head) {
    const int page = tile_pages[pos / KV_PAGE - page0];
    return (const uint4*)(k_pool + ((size_t)page * KV_PAGE + pos % KV_PAGE) * KV_DIM + kv_head * HEAD_DIM);
}

// Short parts (up to SCORE_ROWS positions): four threads a position, each a quarter of the dimensions. Quarter qd
// reads 16-byte pieces 4c + qd of the key row, so the four read 64 contiguous bytes at once and a thread's loads
// are all in flight together; the padding puts the four quarters' query reads in different banks. Rows past the
// part get -inf.
#define SCORE_ROWS (ATTN_THREADS / 4)
__device__ __forceinline__ void score_quartered(const float* qs, const bf16* k_pool, const int* tile_pages,
                                                int kv_head, int tile, int end, float (*p)[GQA]) {
    constexpr int PIECES = HEAD_DIM / 8 / 4;
    const int qd = threadIdx.x % 4, row = threadIdx.x / 4, pos = tile + row;
    float s[GQA], s_odd[GQA];
#pragma unroll
    for (int h = 0; h < GQA; h++) s[h] = 0.f, s_odd[h] = 0.f;
    if (pos < end) {
        const uint4* krow = key_row(k_pool, tile_pages, tile / KV_PAGE, pos, kv_head);
        uint4 raw[PIECES];
#pragma unroll
        for (int c = 0; c < PIECES; c++) raw[c] = krow[4 * c + qd];
#pragma unroll
        for (int c = 0; c < PIECES; c++) score_piece(qs, raw[c], 8 * (4 * c + qd), s, s_odd);
    }
#pragma unroll
    for (int h = 0; h < GQA; h++) {
        s[h] += s_odd[h];
        s[h] += __shfl_xor_sync(0xffffffffu, s[h], 1);
        s[h] += __shfl_xor_sync(0xffffffffu, s[h], 2);
    }
    if (qd == 0) store_scores(p[row], s, pos < end);
    for (int r = SCORE_ROWS + threadIdx.x; r < ATTN_TILE; r += ATTN_THREADS) store_scores(p[r], s, false);
}

// Longer parts: a thread a position, a whole tile at once.
__device__ __forceinline__ void score_whole(const float* qs, const bf16* k_pool, const int* tile_pages, int kv_head,
                                            int tile, int end, float (*p)[GQA]) {
    const int pos = tile + threadIdx.x;
    float s[GQA], s_odd[GQA];
#pragma unroll
    for (int h = 0; h < GQA; h++) s[h] = 0.f, s_odd[h] = 0.f;
    if (pos < end) {
        const uint4* krow = key_row(k_pool, tile_pages, tile / KV_PAGE, pos, kv_head);
#pragma unroll 8
        for (int c = 0; c < HEAD_DIM / 8; c++) score_piece(qs, krow[c], 8 * c, s, s_odd);
    }
#pragma unroll
    for (int h = 0; h < GQA; h++) s[h] += s_odd[h];
    store_scores(p[threadIdx.x], s, pos < end);
}

// Part blockIdx.y (of `splits`) of row blockIdx.z's context [0, position]: positions [start, end) (empty where
// the row's context has fewer parts) and the row's page-table row; moves q, part_o and part_ml to the row.
struct AttnPart {
    int start, end;
    const int* pages;
};
__device__ __forceinline__ AttnPart attn_part(const int* positions, const int* slots, const int* page_table,
                                              int pages_per_seq, int splits, const float*& q, float*& part_o,
                                              float*& part_ml) {
    const int row = blockIdx.z;
    const int len = positions[row] + 1;
    const int* pages = page_table + (size_t)slots[row] * pages_per_seq;
    q += (size_t)row * Q_DIM;
    part_o += row * PART_O_ROW;
    part_ml += row * PART_ML_ROW;
    const int chunk = attn_chunk(len, splits);
    const int start = blockIdx.y * chunk;
    return AttnPart{start, min(len, start + chunk), pages};
}

// Grid (N_KV_HEADS, splits, rows). Part `split` of the row's context [0, position] for the GQA query heads of
// a KV head: writes the unnormalised output, the running max and the sum of exponentials per query head. Each tile
// of positions first takes the ids of the pages it touches into shared memory.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attn_partial(const int* positions, const int* slots, const float* q, const bf16* k_pool, const bf16* v_pool,
                 const int* page_table, int pages_per_seq, int splits, float* part_o, float* part_ml) {
    __shared__ __align__(16) float qs[HEAD_DIM * GQA + HEAD_DIM / 2];  // see q_at
    __shared__ __align__(16) float p[ATTN_TILE][GQA];
    __shared__ float run_max[GQA], run_sum[GQA], rescale[GQA];
    __shared__ __align__(16) float red[ATTN_WARPS][HEAD_DIM];
    __shared__ int tile_pages[TILE_PAGES];
    // The positions, slots and page table are not written by this step's kernels: the first tile's page ids are
    // requested before the wait.
    const AttnPart part = attn_part(positions, slots, page_table, pages_per_seq, splits, q, part_o, part_ml);
    const int* pages = part.pages;
    const int kv_head = blockIdx.x, split = blockIdx.y, start = part.start, end = part.end;
    const int t = threadIdx.x, lane = t % WARP, warp = t / WARP;
    // The pages of positions tile .. min(end, tile + ATTN_TILE) - 1 go to tile_pages[0 ..].
    auto tile_page_count = [&](int tile) { return (min(end, tile + ATTN_TILE) - 1) / KV_PAGE - tile / KV_PAGE + 1; };
    const bool loads_first_page = start < end && t < tile_page_count(start);
    const int first_page = loads_first_page ? pages[start / KV_PAGE + t] : 0;
    wait_previous();
    if (start >= end) return;
    if (loads_first_page) tile_pages[t] = first_page;
    {
        float qv[GQA];  // thread t loads dimension t of each head: all loads in flight at once
#pragma unroll
        for (int h = 0; h < GQA; h++) qv[h] = q[(kv_head * GQA + h) * HEAD_DIM + t];
#pragma unroll
        for (int h = 0; h < GQA; h++) qs[q_at(t) + h] = qv[h];
    }
    if (t < GQA) run_max[t] = -INF_F, run_sum[t] = 0.f;
    float acc[GQA][8];
#pragma unroll
    for (int h = 0; h < GQA; h++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[h][j] = 0.f;
    __syncthreads();

    for (int tile = start; tile < end; tile += ATTN_TILE) {
        const int page0 = tile / KV_PAGE;
        if (tile != start) {
            // The previous tile's readers of tile_pages are past the loop's closing barrier.
            if (t < tile_page_count(tile)) tile_pages[t] = pages[page0 + t];
            __syncthreads();
        }
        if (end - start <= SCORE_ROWS)
            score_quartered(qs, k_pool, tile_pages, kv_head, tile, end, p);
        else
            score_whole(qs, k_pool, tile_pages, kv_head, tile, end, p);
        __syncthreads();
        // Warp h: the tile's max for head h, the new running max, and the rescale of what came before.
        {
            const int h = warp;
            float m = -INF_F;
            for (int i = lane; i < ATTN_TILE; i += WARP) m = fmaxf(m, p[i][h]);
            m = warp_max(m);
            const float new_max = fmaxf(run_max[h], m);
            float sum = 0.f;
            for (int i = lane; i < ATTN_TILE; i += WARP) {
                const float e = p[i][h] == -INF_F ? 0.f : expf(p[i][h] - new_max);
                p[i][h] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            __syncwarp();
            if (lane == 0) {
                const float r = run_max[h] == -INF_F ? 0.f : expf(run_max[h] - new_max);
                rescale[h] = r;
                run_sum[h] = run_sum[h] * r + sum;
                run_max[h] = new_max;
            }
        }
        __syncthreads();
        // Values: warp w takes the tile's positions w, w + WARPS, ...; lane l owns dimensions 8l .. 8l + 7 of the GQA
        // heads' outputs, one 16-byte load of a value row each, many rows in flight.
#pragma unroll
        for (int h = 0; h < GQA; h++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[h][j] *= rescale[h];
        const int n = min(ATTN_TILE, end - tile);
        const bf16* vrows = v_pool + kv_head * HEAD_DIM + 8 * lane;
#pragma unroll 4
        for (int i = warp; i < n; i += ATTN_WARPS) {
            const int pos = tile + i;
            const size_t at = ((size_t)tile_pages[pos / KV_PAGE - page0] * KV_PAGE + pos % KV_PAGE) * KV_DIM;
            const uint4 raw = *(const uint4*)(vrows + at);
            const u32 v2[4] = {raw.x, raw.y, raw.z, raw.w};
            float v[8];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float2 f = pair_to_float2(v2[e]);
                v[2 * e] = f.x, v[2 * e + 1] = f.y;
            }
            const float4 pa = *(const float4*)&p[i][0], pb = *(const float4*)&p[i][4];
            const float ph[GQA] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
            for (int h = 0; h < GQA; h++)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[h][j] = fmaf(ph[h], v[j], acc[h][j]);
        }
        __syncthreads();
    }
    // The warps' sums, one head at a time through shared memory; thread t writes dimension t.
#pragma unroll
    for (int h = 0; h < GQA; h++) {
        *(float4*)&red[warp][8 * lane] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
        *(float4*)&red[warp][8 * lane + 4] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
        __syncthreads();
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) o += red[w][t];
        part_o[((size_t)(kv_head * GQA + h) * ATTN_SPLITS + split) * HEAD_DIM + t] = o;
        __syncthreads();
    }
    if (t < GQA) {
        const int qh = kv_head * GQA + t;
        part_ml[(qh * ATTN_SPLITS + split) * 2] = run_max[t];
        part_ml[(qh * ATTN_SPLITS + split) * 2 + 1] = run_sum[t];
    }
}

// ---- A batched step's parts on the tensor cores ----
// attn_partial_rows computes what attn_partial does (the same grid of (KV head, part, row), parts and outputs) with
// mma.sync m16n8k16 (bf16 in, f32 accumulation), for the batched step, whose rows' attention reads every row's
// keys and values once and should run at the memory's speed. A block of ROWS_WARPS warps walks its part in tiles of
// one page (64 positions), keys and values brought by cp.async into ROWS_STAGES stages of XOR-swizzled shared rows
// (the tiles after the current one load while it is used). Warp w takes positions 16w .. 16w + 15 of every tile
// and keeps its own running max, sum and output for the 8 query heads; the warps' results are merged at the end.
//
// Per tile and warp: S = Q K^T with Q as A (the 8 heads in rows 0..7, rows 8..15 zero) and the keys as B (two
// n8 tiles), so each lane's scores of head g are exactly its B fragment of P for O^T = V^T P^T (A = V^T by
// ldmatrix.trans, dims in m). The query and P enter as bf16 pairs hi + lo (two products each), and keys and values
// are bf16 already, so the results match attn_partial's f32 arithmetic to ~2^-16 of each term.
#ifndef ROWS_STAGES
#define ROWS_STAGES 3
#endif
#define ROWS_WARPS 4
#define ROWS_THREADS (ROWS_WARPS * WARP)
#define ROWS_TILE KV_PAGE
#define KV_TILE_BYTES (ROWS_TILE * ROW_BYTES)
#define Q_ROW_BYTES (ROW_BYTES + 16)  // padded: the 8 heads' A loads fall in distinct banks
#define ROWS_SMEM (ROWS_STAGES * 2 * KV_TILE_BYTES + 2 * GQA * Q_ROW_BYTES)
static_assert(ROWS_WARPS * 16 == ROWS_TILE, "a warp takes 16 positions of a tile");
static_assert((ROWS_TILE * ROW_CHUNKS) % ROWS_THREADS == 0, "every thread copies as many chunks of a tile");
static_assert(ROWS_WARPS * GQA * HEAD_DIM * 4 <= ROWS_STAGES * 2 * KV_TILE_BYTES, "the warps' outputs fit the stages");
static_assert(HEAD_DIM % 16 == 0 && ATTN_MIN_CHUNK % KV_PAGE == 0, "whole k16 steps; parts of whole pages");

// Read by the host: the kernel's dynamic shared memory.
__device__ int attn_rows_smem = ROWS_SMEM;

// Blocks an SM that the host's split of a batched step's contexts aims for (attention_splits in batch.rs): rows x
// KV heads x parts ~ this many times the SMs. A block takes its SM's shared memory alone, so each block an SM is a
// wave of its own that pays its first tiles' latency again: one wave, each block walking a longer part, is the
// fastest (two are as fast at 64 rows and more, eight are slower).
#ifndef ATTN_ROWS_BLOCKS_PER_SM
#define ATTN_ROWS_BLOCKS_PER_SM 1
#endif
__device__ int attn_rows_blocks_per_sm = ATTN_ROWS_BLOCKS_PER_SM;

// Two floats as bf16 pairs: `hi` rounded to nearest even, `lo` the rounded remainder (x ~ hi + lo to ~2^-16 of x),
// `a` in the low half of each (the lower address / column).
__device__ __forceinline__ void split_bf16x2(float a, float b, u32& hi, u32& lo) {
    hi = pack_bf16x2(a, b);
    lo = pack_bf16x2(a - __uint_as_float(hi << 16), b - __uint_as_float(hi & 0xffff0000u));
}

extern "C" __global__ void __launch_bounds__(ROWS_THREADS)
    attn_partial_rows(const int* positions, const int* slots, const float* q, const bf16* k_pool, const bf16* v_pool,
                      const int* page_table, int pages_per_seq, int splits, float* part_o, float* part_ml) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ float warp_m[ROWS_WARPS][GQA], warp_l[ROWS_WARPS][GQA];
    const AttnPart part = attn_part(positions, slots, page_table, pages_per_seq, splits, q, part_o, part_ml);
    const int* pages = part.pages;
    const int kv_head = blockIdx.x, split = blockIdx.y, start = part.start, end = part.end;
    const int t = threadIdx.x, lane = t % WARP, warp = t / WARP, g = lane / 4, tq = lane % 4;
    wait_previous();
    if (start >= end) return;
    const u32 kv_base = shared_address(smem), q_hi = kv_base + ROWS_STAGES * 2 * KV_TILE_BYTES;
    const u32 q_lo = q_hi + GQA * Q_ROW_BYTES;
    const int tiles = (end - start + ROWS_TILE - 1) / ROWS_TILE;

    // Tile i (positions start + 64 i ..) into stage i % ROWS_STAGES: keys, then values; rows past `end` zeroed.
    auto load_tile = [&](int i) {
        const int tile = start + i * ROWS_TILE;
        const size_t base = (size_t)pages[tile / KV_PAGE] * KV_PAGE * KV_DIM + kv_head * HEAD_DIM;
        const u32 k_dst = kv_base + (i % ROWS_STAGES) * 2 * KV_TILE_BYTES, v_dst = k_dst + KV_TILE_BYTES;
#pragma unroll
        for (int j = 0; j < ROWS_TILE * ROW_CHUNKS / ROWS_THREADS; j++) {
            const int c = t + j * ROWS_THREADS, r = c / ROW_CHUNKS, ch = c % ROW_CHUNKS;
            const bool valid = tile + r < end;
            const size_t at = valid ? base + (size_t)r * KV_DIM + ch * 8 : base;
            cp_async_16(k_dst + swizzled(r, ch), k_pool + at, valid ? 16u : 0u);
            cp_async_16(v_dst + swizzled(r, ch), v_pool + at, valid ? 16u : 0u);
        }
    };
#pragma unroll
    for (int i = 0; i < ROWS_STAGES - 1; i++) {
        if (i < tiles) load_tile(i);
        cp_async_commit();
    }
    // The GQA heads' queries as bf16 hi and lo rows, while the first tiles load.
    for (int i = t; i < GQA * HEAD_DIM / 2; i += ROWS_THREADS) {
        const int h = i / (HEAD_DIM / 2), d = 2 * (i % (HEAD_DIM / 2));
        const float2 x = *(const float2*)&q[(kv_head * GQA + h) * HEAD_DIM + d];
        u32 hi, lo;
        split_bf16x2(x.x, x.y, hi, lo);
        const u32 at = h * Q_ROW_BYTES + d * 2;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(q_hi + at), "r"(hi));
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(q_lo + at), "r"(lo));
    }

    float run_m = -INF_F, run_l = 0.f;  // head g's, the same in the 4 lanes of a quad
    float o[HEAD_DIM / 16][4];          // O^T: dims 16 i + g (+ 8) by heads 2 tq, 2 tq + 1
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 16; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    const int key0 = 16 * warp;
    for (int i = 0; i < tiles; i++) {
        cp_async_wait<ROWS_STAGES - 2>();
        // Tile i is in; every warp is past tile i - 1, whose stage the next load reuses.
        __syncthreads();
        if (i + ROWS_STAGES - 1 < tiles) load_tile(i + ROWS_STAGES - 1);
        cp_async_commit();
        const u32 k_s = kv_base + (i % ROWS_STAGES) * 2 * KV_TILE_BYTES, v_s = k_s + KV_TILE_BYTES;
        const int tile = start + i * ROWS_TILE;

        // Scores of head g at positions key0 + 8 j + 2 tq (+1): s[j][hi/lo][kk parity][0..1], independent chains.
        float s[2][2][2][4] = {};
        const int mat = lane / 8, mat_row = key0 + (mat / 2) * 8 + lane % 8;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
            u32 b[4];
            ldmatrix_x4(b, k_s + swizzled(mat_row, 2 * kk + (mat & 1)));
            u32 ahi[4], alo[4];
            const u32 at = g * Q_ROW_BYTES + (16 * kk + 2 * tq) * 2;
            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(ahi[0]) : "r"(q_hi + at));
            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(ahi[2]) : "r"(q_hi + at + 16));
            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(alo[0]) : "r"(q_lo + at));
            asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(alo[2]) : "r"(q_lo + at + 16));
            ahi[1] = ahi[3] = alo[1] = alo[3] = 0u;
            mma_bf16(s[0][0][kk & 1], ahi, b[0], b[1]);
            mma_bf16(s[1][0][kk & 1], ahi, b[2], b[3]);
            mma_bf16(s[0][1][kk & 1], alo, b[0], b[1]);
            mma_bf16(s[1][1][kk & 1], alo, b[2], b[3]);
        }
        float p[2][2];
        float mx = -INF_F;
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float v = (s[j][0][0][e] + s[j][0][1][e]) + (s[j][1][0][e] + s[j][1][1][e]);
                p[j][e] = tile + key0 + 8 * j + 2 * tq + e < end ? v : -INF_F;
                mx = fmaxf(mx, p[j][e]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float new_m = fmaxf(run_m, mx);
        const float r = run_m == -INF_F ? 0.f : expf(run_m - new_m);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                p[j][e] = p[j][e] == -INF_F ? 0.f : expf(p[j][e] - new_m);
                sum += p[j][e];
            }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        run_l = run_l * r + sum;
        run_m = new_m;
        // The output's columns are heads 2 tq and 2 tq + 1, whose rescale lanes 4 (2 tq) and 4 (2 tq + 1) hold.
        const float r0 = __shfl_sync(0xffffffffu, r, 8 * tq), r1 = __shfl_sync(0xffffffffu, r, 8 * tq + 4);
        u32 p_hi[2], p_lo[2];
        split_bf16x2(p[0][0], p[0][1], p_hi[0], p_lo[0]);
        split_bf16x2(p[1][0], p[1][1], p_hi[1], p_lo[1]);
#pragma unroll
        for (int m = 0; m < HEAD_DIM / 16; m++) {
            o[m][0] *= r0, o[m][1] *= r1, o[m][2] *= r0, o[m][3] *= r1;
            u32 a[4];
            ldmatrix_x4_trans(a, v_s + swizzled(mat_row, 2 * m + (mat & 1)));
            mma_bf16(o[m], a, p_hi[0], p_hi[1]);
            mma_bf16(o[m], a, p_lo[0], p_lo[1]);
        }
    }

    // The warps' parts merged: each warp's max and sum per head, then its output rescaled to the block's max.
    cp_async_wait<0>();
    __syncthreads();
    float* red = (float*)smem;  // [warp][head][dim]
    if (tq == 0) warp_m[warp][g] = run_m, warp_l[warp][g] = run_l;
#pragma unroll
    for (int m = 0; m < HEAD_DIM / 16; m++) {
        float* at = red + (warp * GQA + 2 * tq) * HEAD_DIM + 16 * m + g;
        at[0] = o[m][0], at[HEAD_DIM] = o[m][1], at[8] = o[m][2], at[HEAD_DIM + 8] = o[m][3];
    }
    __syncthreads();
    constexpr int DIMS = GQA * HEAD_DIM / ROWS_THREADS;  // outputs a thread writes
    const int h = t / (HEAD_DIM / DIMS), d0 = (t % (HEAD_DIM / DIMS)) * DIMS;
    float block_m = -INF_F;
#pragma unroll
    for (int w = 0; w < ROWS_WARPS; w++) block_m = fmaxf(block_m, warp_m[w][h]);
    float scale[ROWS_WARPS], block_l = 0.f;
#pragma unroll
    for (int w = 0; w < ROWS_WARPS; w++) {
        scale[w] = warp_m[w][h] == -INF_F ? 0.f : expf(warp_m[w][h] - block_m);
        block_l += warp_l[w][h] * scale[w];
    }
    float* out = part_o + ((size_t)(kv_head * GQA + h) * ATTN_SPLITS + split) * HEAD_DIM + d0;
#pragma unroll
    for (int d = 0; d < DIMS; d += 4) {
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < ROWS_WARPS; w++) {
            const float4 x = *(const float4*)&red[(w * GQA + h) * HEAD_DIM + d0 + d];
            v.x += scale[w] * x.x, v.y += scale[w] * x.y, v.z += scale[w] * x.z, v.w += scale[w] * x.w;
        }
        *(float4*)&out[d] = v;
    }
    if (d0 == 0) {
        const int qh = kv_head * GQA + h;
        part_ml[(qh * ATTN_SPLITS + split) * 2] = block_m;
        part_ml[(qh * ATTN_SPLITS + split) * 2 + 1] = block_l;
    }
}

// Grid (N_HEADS, HEAD_DIM / WARP, rows): a block merges the parts for one query head's 32-dimension slice, lane =
// dimension; warp w takes parts w, w + MERGE_WARPS, ... against the maximum over all parts, and the warps' sums
// meet in shared memory. Then the output gate: attn = o * sigmoid(gate), written as f32 to `attn` and as bf16 to
// `attn_bf16` (the batched step's o_proj input), each when not null.
#define MERGE_WARPS 8
extern "C" __global__ void __launch_bounds__(MERGE_WARPS * WARP)
    attn_merge(const int* positions, int splits, const float* part_o, const float* part_ml, const float* proj,
               float* attn, bf16* attn_bf16) {
    wait_previous();
    __shared__ float warp_max_s[MERGE_WARPS];
    __shared__ float num_s[MERGE_WARPS][WARP];
    __shared__ float den_s[MERGE_WARPS];
    const int row = blockIdx.z;
    const int len = positions[row] + 1;
    part_o += row * PART_O_ROW;
    part_ml += row * PART_ML_ROW;
    proj += (size_t)row * PROJ_ROW;
    const int parts = (len + attn_chunk(len, splits) - 1) / attn_chunk(len, splits);
    const int qh = blockIdx.x, lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int d = blockIdx.y * WARP + lane;
    const float* ml = part_ml + (size_t)qh * ATTN_SPLITS * 2;
    float mx = -INF_F;
    for (int s = threadIdx.x; s < parts; s += MERGE_WARPS * WARP) mx = fmaxf(mx, ml[2 * s]);
    mx = warp_max(mx);
    if (lane == 0) warp_max_s[warp] = mx;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < MERGE_WARPS; w++) mx = fmaxf(mx, warp_max_s[w]);
    float num = 0.f, den = 0.f;
#pragma unroll 4
    for (int s = warp; s < parts; s += MERGE_WARPS) {
        const float weight = expf(ml[2 * s] - mx);
        num += weight * part_o[((size_t)qh * ATTN_SPLITS + s) * HEAD_DIM + d];
        den += weight * ml[2 * s + 1];
    }
    num_s[warp][lane] = num;
    if (lane == 0) den_s[warp] = den;
    __syncthreads();
    if (warp == 0) {
        float n = 0.f, total = 0.f;
#pragma unroll
        for (int w = 0; w < MERGE_WARPS; w++) n += num_s[w][lane], total += den_s[w];
        const float gate = proj[qh * 2 * HEAD_DIM + HEAD_DIM + d];
        const float y = n / total * sigmoidf_(gate);
        const size_t at = (size_t)row * Q_DIM + qh * HEAD_DIM + d;
        if (attn) attn[at] = y;
        if (attn_bf16) attn_bf16[at] = float_to_bf16(y);
    }
}

// The batched step's merge where each row has few parts (splits <= MERGE_ROWS_MAX_SPLITS; many rows leave few parts
// a row): attn_merge's arithmetic with one warp per (row, query head, 32-dimension slice), lane = dimension, over
// the row's parts in order, and the bf16 output only. attn_merge's grid of eight warps for each slice would leave
// most of them without a part. Grid: ceil(rows * N_HEADS * HEAD_DIM / WARP / MERGE_WARPS) blocks, a block one (row,
// query head). Where `codes.codes` is not null, the bf16 rows also as the Q8x2 codes that o_proj's integer small
// tiling reads (what gemm_quantize_rows would make of them): a group of the codes is two warps' slices.
#define MERGE_ROWS_MAX_SPLITS 8
__device__ int attn_merge_rows_max_splits = MERGE_ROWS_MAX_SPLITS;
extern "C" __global__ void __launch_bounds__(MERGE_WARPS * WARP)
    attn_merge_rows(const int* positions, int rows, int splits, const float* part_o, const float* part_ml,
                    const float* proj, bf16* attn_bf16, Q8x2 codes) {
    wait_previous();
    constexpr int SLICES = HEAD_DIM / WARP;
    static_assert(SLICES == MERGE_WARPS && GROUP == 2 * WARP, "a block is a head, a group two of its warps");
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, item = blockIdx.x * MERGE_WARPS + warp;
    if (item >= rows * N_HEADS * SLICES) return;  // whole blocks: rows * N_HEADS * SLICES is a multiple of them
    const int row = item / (N_HEADS * SLICES), qh = item / SLICES % N_HEADS, d = item % SLICES * WARP + lane;
    const int len = positions[row] + 1;
    const int parts = (len + attn_chunk(len, splits) - 1) / attn_chunk(len, splits);
    const float* ml = part_ml + row * PART_ML_ROW + (size_t)qh * ATTN_SPLITS * 2;
    const float* o = part_o + row * PART_O_ROW + (size_t)qh * ATTN_SPLITS * HEAD_DIM + d;
    float mx = -INF_F;
    for (int s = 0; s < parts; s++) mx = fmaxf(mx, ml[2 * s]);
    float num = 0.f, den = 0.f;
    for (int s = 0; s < parts; s++) {
        const float weight = expf(ml[2 * s] - mx);
        num += weight * o[(size_t)s * HEAD_DIM];
        den += weight * ml[2 * s + 1];
    }
    const float gate = proj[(size_t)row * PROJ_ROW + qh * 2 * HEAD_DIM + HEAD_DIM + d];
    const bf16 y = float_to_bf16(num / den * sigmoidf_(gate));
    attn_bf16[(size_t)row * Q_DIM + qh * HEAD_DIM + d] = y;
    if (!codes.codes) return;  // uniform: o_proj does not take the small tiling
    // Each lane gathers its word (8 dimensions, lanes 8u .. 8u + 7); the group's largest magnitude and sum come from
    // its two warps through shared memory.
    __shared__ float group_mx[MERGE_WARPS], group_sum[MERGE_WARPS];
    const float value = bf16_to_float(y);
    float word_v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) word_v[i] = __shfl_sync(0xffffffffu, value, (lane & ~7) + i);
    float warp_mx = fabsf(value), warp_sum_v = value;
#pragma unroll
    for (int off = WARP / 2; off > 0; off /= 2) {
        warp_mx = fmaxf(warp_mx, __shfl_xor_sync(0xffffffffu, warp_mx, off));
        warp_sum_v += __shfl_xor_sync(0xffffffffu, warp_sum_v, off);
    }
    if (lane == 0) group_mx[warp] = warp_mx, group_sum[warp] = warp_sum_v;
    __syncthreads();
    const int first = warp & ~1;  // the group's first warp
    const float g_mx = fmaxf(group_mx[first], group_mx[first + 1]), g_sum = group_sum[first] + group_sum[first + 1];
    const size_t word = (size_t)row * (Q_DIM / 8) + qh * (HEAD_DIM / 8) + warp * (WARP / 8) + lane / 8;
    const size_t pair = (size_t)row * (Q_DIM / GROUP) + qh * (HEAD_DIM / GROUP) + warp / 2;
    code_word_q8x2(word_v, g_mx, g_sum, (warp % 2) * (WARP / 8) + lane / 8, lane % 8 == 0,
                   (uint4*)codes.codes + word, (float2*)codes.pairs + pair);
}
