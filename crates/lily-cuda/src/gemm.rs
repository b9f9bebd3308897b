//! The prefill's matrix products on the tensor cores (kernels/gemm.cu): bf16 activations times the 4-bit weights
//! (the router's 8-bit) as they lie in memory, f32 out; the shared expert's gate/up pair with its SwiGLU; the
//! routed experts' grouped products over the entries sorted by expert.
//!
//! Launch geometry (the constants mirror gemm.cu): blocks of 256 threads; a block covers 256 weight rows (a
//! gate/up pair: 128 rows of each) by 64 or 128 activation rows, grid (weight-row blocks, activation-row blocks)
//! for the dense products and (column blocks, tiles) for the grouped ones; dynamic shared memory holds
//! `gemm_stages` pipeline stages of an activation tile (rows x 64 bf16), the packed weight tile (256 rows x 64
//! codes) and its 256 scale/bias pairs.

use half::bf16;
use lily_model::cpu::linalg::{qmatmul, silu};
use lily_model::quant::{Blob, QMatrix};
use lily_model::rng::Rng;
use lily_model::Config;

use crate::driver::{DevBuf, DevPtr, Gpu, Result};
use crate::kernels::{gemm, Kernels};
use crate::launch::{Dims, Launcher};
use crate::selftest::{download_f32, normals, poison, rel_err, Report};
use crate::weights::{upload, GpuMatrix};

/// Threads of every block (GEMM_THREADS).
const THREADS: u32 = 256;
/// Weight rows a block covers (WROWS).
const WEIGHT_ROWS: usize = 256;
/// Inputs per step of the k loop: one quantization group (KT).
const K_STEP: usize = 64;

/// Dynamic shared memory of a block with `rows`-row activation tiles and `bits`-bit weights (Tile::SMEM).
fn shared_bytes(kernels: &Kernels, rows: usize, bits: u32) -> u32 {
    let stage = rows * K_STEP * 2 + WEIGHT_ROWS * K_STEP * bits as usize / 8 + WEIGHT_ROWS * 4;
    (kernels.constant("gemm_stages") * stage) as u32
}

/// Activation rows per block tile of a dense product: 64 up to m = 64; beyond, 128 unless 64-row tiles finish in
/// fewer rounds of blocks over the SMs (one block per SM; a 64-row tile is taken to cost 0.6 of a 128-row one:
/// half the products, the same dequantization).
fn tile_rows(m: usize, col_blocks: usize, sms: usize) -> usize {
    let rounds = |rows: usize| (m.div_ceil(rows) * col_blocks).div_ceil(sms) as f64;
    if m <= 64 || rounds(64) * 0.6 < rounds(128) {
        64
    } else {
        128
    }
}

/// The kernels infer the tile height from the row-block count, which tells 64 from 128 for every m > 64.
fn dense_grid(m: usize, k: usize, col_blocks: usize, rows: usize) -> (u32, u32, u32) {
    assert!(
        m >= 1 && (rows == 64 || rows == 128 && m > 64),
        "{rows}-row tiles for m = {m}"
    );
    assert!(
        k >= K_STEP && k.is_multiple_of(K_STEP),
        "k = {k} is not whole groups of {K_STEP}"
    );
    assert!(m.div_ceil(rows) <= 65535, "m = {m} is too many row blocks");
    (col_blocks as u32, m.div_ceil(rows) as u32, 1)
}

/// `out[m][n] = a[m][k] w[n][k]^T` (or `+=` with `accumulate`), `a` bf16 and `out` f32 row-major, n = w.rows,
/// k = w.cols; 4-bit or 8-bit by `w.bits`.
pub fn gemm(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    w: &GpuMatrix,
    out: DevPtr<f32>,
    accumulate: bool,
) -> Result<()> {
    let rows = tile_rows(m, w.rows.div_ceil(WEIGHT_ROWS), l.gpu.sm_count);
    gemm_tiles(l, a, m, w, out, accumulate, rows)
}

pub(crate) fn gemm_tiles(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    w: &GpuMatrix,
    out: DevPtr<f32>,
    accumulate: bool,
    rows: usize,
) -> Result<()> {
    let launch = match w.bits {
        4 => gemm::gemm_q4,
        8 => gemm::gemm_q8,
        bits => panic!("no {bits}-bit product"),
    };
    let grid = dense_grid(m, w.cols, w.rows.div_ceil(WEIGHT_ROWS), rows);
    let dims = Dims::new(grid, THREADS).shared(shared_bytes(l.kernels, rows, w.bits));
    let (n, k) = (w.rows as i32, w.cols as i32);
    launch(l, dims, a, m as i32, w.q4(), n, k, out, accumulate as i32)
}

/// `out[m][n] = bf16(silu(a gate^T) * (a up^T))`, bf16 `a` and `out` row-major, n = gate.rows, k = gate.cols.
pub fn gemm_swiglu(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    gate: &GpuMatrix,
    up: &GpuMatrix,
    out: DevPtr<bf16>,
) -> Result<()> {
    let rows = tile_rows(m, gate.rows.div_ceil(WEIGHT_ROWS / 2), l.gpu.sm_count);
    gemm_swiglu_tiles(l, a, m, gate, up, out, rows)
}

pub(crate) fn gemm_swiglu_tiles(
    l: &mut Launcher,
    a: DevPtr<bf16>,
    m: usize,
    gate: &GpuMatrix,
    up: &GpuMatrix,
    out: DevPtr<bf16>,
    rows: usize,
) -> Result<()> {
    assert!(
        gate.bits == 4 && up.bits == 4 && gate.rows == up.rows && gate.cols == up.cols,
        "gate and up: 4-bit, one shape"
    );
    let grid = dense_grid(m, gate.cols, gate.rows.div_ceil(WEIGHT_ROWS / 2), rows);
    let dims = Dims::new(grid, THREADS).shared(shared_bytes(l.kernels, rows, 4));
    let (n, k) = (gate.rows as i32, gate.cols as i32);
    gemm::gemm_q4_swiglu(l, dims, a, m as i32, gate.q4(), up.q4(), n, k, out)
}

/// Tiles of the grouped expert products for `tokens` tokens at most: each expert's sorted entries in tiles of
/// `moe_tile_rows`, so at most one partial tile per expert.
pub fn max_tiles(kernels: &Kernels, config: &Config, tokens: usize) -> usize {
    (tokens * config.num_experts_per_tok).div_ceil(kernels.constant("moe_tile_rows")) + config.num_experts
}

/// The (token, slot) entries sorted by expert, as the grouped products read them: `entries` (i32, sorted index to
/// entry), `offsets` (i32 `[experts + 1]`, each expert's first sorted index), `tiles` (i32 `[max_tiles][2]`: an
/// expert and its tile's first sorted index) and `tile_count` (i32: tiles in use).
pub struct Sorted {
    pub entries: DevPtr<i32>,
    pub tiles: DevPtr<i32>,
    pub tile_count: DevPtr<i32>,
    pub offsets: DevPtr<i32>,
    pub max_tiles: usize,
}

/// Each grouped product's geometry: (column blocks, every possible tile), `gemm_stages` stages of `moe_tile_rows`
/// rows.
fn grouped_dims(l: &Launcher, col_blocks: &'static str, max_tiles: usize) -> Dims {
    let grid = (l.kernels.constant(col_blocks) as u32, max_tiles as u32, 1);
    Dims::new(grid, THREADS).shared(shared_bytes(l.kernels, l.kernels.constant("moe_tile_rows"), 4))
}

/// `act[i][:] = bf16(silu(gate_e x[token]) * (up_e x[token]))` for every sorted entry i (token = entries[i] /
/// top_k, e its expert); `x` bf16 `[tokens][hidden]`, `act` bf16 `[tokens * top_k][moe inter]`. Blocks past
/// `*tile_count` return at once.
pub fn moe_gate_up(
    l: &mut Launcher,
    x: DevPtr<bf16>,
    s: &Sorted,
    gate: &GpuMatrix,
    up: &GpuMatrix,
    act: DevPtr<bf16>,
) -> Result<()> {
    let dims = grouped_dims(l, "moe_gate_up_col_blocks", s.max_tiles);
    gemm::moe_gate_up(
        l,
        dims,
        x,
        s.entries,
        s.tiles,
        s.tile_count,
        s.offsets,
        gate.q4(),
        up.q4(),
        act,
    )
}

/// `out[entries[i]][:] = route_w[entries[i]] * (down_e act[i])` for every sorted entry i; `out` f32
/// `[tokens * top_k][hidden]` and `route_w` f32 `[tokens * top_k]`, both by entry.
pub fn moe_down(
    l: &mut Launcher,
    act: DevPtr<bf16>,
    s: &Sorted,
    route_w: DevPtr<f32>,
    down: &GpuMatrix,
    out: DevPtr<f32>,
) -> Result<()> {
    let dims = grouped_dims(l, "moe_down_col_blocks", s.max_tiles);
    gemm::moe_down(
        l,
        dims,
        act,
        s.entries,
        s.tiles,
        s.tile_count,
        s.offsets,
        route_w,
        down.q4(),
        out,
    )
}

// ---- `lily selftest`: the products against lily_model's qmatmul on the same bf16-rounded inputs ----
//
// Tolerances (max error over max |reference|). The 4-bit weights reach the tensor cores rounded to bf16 once
// (scale * q + bias, relative error <= 2^-9 each); the activations are exact and the sums f32, so the error
// is a sum of independent weight roundings: about 1.6e-3 of the largest output on random data (measured with
// numpy at k = 128 .. 4096). f32 outputs: 5e-3. bf16 outputs (SwiGLU) add their own rounding (2^-9 of each
// value) to that: 1e-2. The 8-bit path splits each weight into bf16 hi + lo (error ~2^-17) and leaves only
// f32 summation: 1e-4.

const TOL_Q4: f64 = 5e-3;
const TOL_Q4_BF16_OUT: f64 = 1e-2;
const TOL_Q8: f64 = 1e-4;
const NAN_BF16X2: u32 = 0x7fc0_7fc0;

/// `n` standard normals rounded to bf16: the device copy and its exact f32 values.
fn bf16_normals(rng: &mut Rng, n: usize) -> (Vec<bf16>, Vec<f32>) {
    let bits: Vec<bf16> = normals(rng, n, 1.0).into_iter().map(bf16::from_f32).collect();
    let values = bits.iter().map(|v| v.to_f32()).collect();
    (bits, values)
}

fn download_bf16(gpu: &Gpu, buf: &DevBuf<bf16>, n: usize) -> Result<Vec<f32>> {
    let mut out = vec![bf16::ZERO; n];
    gpu.download(buf.ptr(), &mut out)?;
    Ok(out.iter().map(|v| v.to_f32()).collect())
}

/// A random 4-bit matrix made directly in the quantized form (random codes; scales 0.02 .. 0.04 and biases
/// near -7.5 scales, as min/max quantization of zero-centred rows gives): the expert stacks are too large to
/// quantize from floats on the CPU in a selftest.
fn random_q4(rng: &mut Rng, rows: usize, cols: usize) -> QMatrix {
    let packed: Vec<u32> = (0..rows * cols / 8).map(|_| rng.next_u64() as u32).collect();
    let groups = rows * cols / K_STEP;
    let scales: Vec<bf16> = (0..groups)
        .map(|_| bf16::from_f32(0.02 + 0.02 * rng.uniform()))
        .collect();
    let biases: Vec<bf16> = scales
        .iter()
        .map(|s| bf16::from_f32(-7.5 * s.to_f32() * (0.8 + 0.4 * rng.uniform())))
        .collect();
    QMatrix {
        rows,
        cols,
        bits: 4,
        packed: Blob::Owned(packed),
        scales: Blob::Owned(scales),
        biases: Blob::Owned(biases),
    }
}

/// The tile heights a product of m rows can be launched with.
fn tile_heights(m: usize) -> &'static [usize] {
    if m <= 64 {
        &[64]
    } else {
        &[64, 128]
    }
}

/// `lily selftest`'s checks of every product kernel (both tile heights where m allows) against qmatmul.
pub(crate) fn check(gpu: &Gpu, kernels: &Kernels, config: &Config, seed: u64, report: &mut Report) -> Result<()> {
    let mut rng = Rng::new(seed ^ 0x9e33);
    let mut l = Launcher::new(gpu, kernels);
    let (h, inter, experts) = (config.hidden_size, config.moe_intermediate_size, config.num_experts);

    // Dense products: odd and even n, partial tiles in m and n, k steps fewer than the pipeline's stages and not
    // a multiple of them, both tile heights, with and without accumulate.
    let dense: [(usize, usize, usize, u32, bool); 8] = [
        (1, h, 517, 4, false),
        (7, 2 * h, 300, 4, true),
        (300, h, 517, 4, false),
        (300, inter, 258, 4, true),
        (1000, 2 * h, 263, 4, true),
        (1000, h + 3 * K_STEP, 640, 4, false),
        (1, h, experts + 1, 8, false),
        (300, h, experts + 1, 8, true),
    ];
    for (m, k, n, bits, accumulate) in dense {
        let (a_bits, a) = bf16_normals(&mut rng, m * k);
        let w = QMatrix::quantize(&normals(&mut rng, n * k, 1.0), n, k, bits);
        let gw = upload(gpu, &w)?;
        let a_buf = gpu.upload_new(&a_bits)?;
        let mut expected = vec![0.0; m * n];
        qmatmul(w.view(), &a, &mut expected);
        let init = if accumulate {
            normals(&mut rng, m * n, 1.0)
        } else {
            vec![0.0; m * n]
        };
        expected.iter_mut().zip(&init).for_each(|(e, i)| *e += i);
        let out = gpu.alloc(m * n)?;
        for &rows in tile_heights(m) {
            if accumulate {
                gpu.upload(out.ptr(), &init)?;
            } else {
                poison(gpu, &out)?;
            }
            gemm_tiles(&mut l, a_buf.ptr(), m, &gw, out.ptr(), accumulate, rows)?;
            let name = format!(
                "gemm_q{bits} m {m} k {k} n {n}, {rows}-row tiles{}",
                if accumulate { ", accumulate" } else { "" }
            );
            report.check(
                &name,
                rel_err(&download_f32(gpu, &out, m * n)?, &expected),
                if bits == 8 { TOL_Q8 } else { TOL_Q4 },
            );
        }
    }

    // The shared expert's gate/up with SwiGLU, bf16 out.
    for (m, n) in [(7, 131), (300, config.shared_expert_intermediate_size), (1000, 130)] {
        let (a_bits, a) = bf16_normals(&mut rng, m * h);
        let gate = QMatrix::quantize(&normals(&mut rng, n * h, 1.0), n, h, 4);
        let up = QMatrix::quantize(&normals(&mut rng, n * h, 1.0), n, h, 4);
        let (g_gate, g_up) = (upload(gpu, &gate)?, upload(gpu, &up)?);
        let a_buf = gpu.upload_new(&a_bits)?;
        let (mut g, mut u) = (vec![0.0; m * n], vec![0.0; m * n]);
        qmatmul(gate.view(), &a, &mut g);
        qmatmul(up.view(), &a, &mut u);
        let expected: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        let out = gpu.alloc::<bf16>((m * n).div_ceil(2) * 2)?;
        for &rows in tile_heights(m) {
            gpu.memset_u32(out.ptr(), NAN_BF16X2, out.bytes() / 4)?;
            gemm_swiglu_tiles(&mut l, a_buf.ptr(), m, &g_gate, &g_up, out.ptr(), rows)?;
            let name = format!("gemm_q4_swiglu m {m} k {h} n {n}, {rows}-row tiles");
            report.check(
                &name,
                rel_err(&download_bf16(gpu, &out, m * n)?, &expected),
                TOL_Q4_BF16_OUT,
            );
        }
    }

    check_moe(&mut l, config, &mut rng, report)?;
    gpu.sync()
}

/// The grouped expert products on a routing built here: every token picks TOP_K distinct experts, half the
/// tokens three "hot" ones among them (so some experts fill several whole tiles while most have a partial one).
fn check_moe(l: &mut Launcher, config: &Config, rng: &mut Rng, report: &mut Report) -> Result<()> {
    let gpu = l.gpu;
    let (h, inter, experts, top_k) = (
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
    );
    let tokens = 300;
    let tile_rows = l.kernels.constant("moe_tile_rows");
    let hot = [1, experts / 2, experts - 1];
    let mut expert_of = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        let mut chosen: Vec<usize> = if rng.uniform() < 0.5 { hot.to_vec() } else { Vec::new() };
        while chosen.len() < top_k {
            let e = (rng.next_u64() % experts as u64) as usize;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        expert_of.extend(chosen);
    }
    // Entries `token * top_k + slot`, stably sorted by expert; tiles of up to `tile_rows` sorted entries.
    let mut offsets = vec![0i32; experts + 1];
    for &e in &expert_of {
        offsets[e + 1] += 1;
    }
    for e in 0..experts {
        offsets[e + 1] += offsets[e];
    }
    let mut entries: Vec<i32> = (0..(tokens * top_k) as i32).collect();
    entries.sort_by_key(|&entry| expert_of[entry as usize]);
    let mut tiles = Vec::new();
    for e in 0..experts {
        let (start, end) = (offsets[e] as usize, offsets[e + 1] as usize);
        tiles.extend(
            (start..end)
                .step_by(tile_rows)
                .flat_map(|first| [e as i32, first as i32]),
        );
    }
    let tile_count = tiles.len() / 2;
    let max_tiles = max_tiles(l.kernels, config, tokens);
    // Slots past the count hold a tile that would overwrite rows of other experts, were it run.
    tiles.resize(max_tiles * 2, 0);
    for slot in tile_count..max_tiles {
        tiles[2 * slot] = experts as i32 - 1;
    }
    let entries_buf = gpu.upload_new(&entries)?;
    let offsets_buf = gpu.upload_new(&offsets)?;
    let tiles_buf = gpu.upload_new(&tiles)?;
    let count_buf = gpu.upload_new(&[tile_count as i32])?;
    let sorted = Sorted {
        entries: entries_buf.ptr(),
        tiles: tiles_buf.ptr(),
        tile_count: count_buf.ptr(),
        offsets: offsets_buf.ptr(),
        max_tiles,
    };
    let rows_of = |e: usize| {
        entries[offsets[e] as usize..offsets[e + 1] as usize]
            .iter()
            .map(|&entry| entry as usize)
    };

    // Gate/up: act by sorted index.
    let (gate, up) = (random_q4(rng, experts * inter, h), random_q4(rng, experts * inter, h));
    let (g_gate, g_up) = (upload(gpu, &gate)?, upload(gpu, &up)?);
    let (x_bits, x) = bf16_normals(rng, tokens * h);
    let x_buf = gpu.upload_new(&x_bits)?;
    let act = gpu.alloc::<bf16>(tokens * top_k * inter)?;
    gpu.memset_u32(act.ptr(), NAN_BF16X2, act.bytes() / 4)?;
    moe_gate_up(l, x_buf.ptr(), &sorted, &g_gate, &g_up, act.ptr())?;
    let mut expected = vec![0.0; tokens * top_k * inter];
    for e in 0..experts {
        let xs: Vec<f32> = rows_of(e)
            .flat_map(|entry| x[entry / top_k * h..][..h].iter().copied())
            .collect();
        let n = xs.len() / h;
        if n == 0 {
            continue;
        }
        let (mut g, mut u) = (vec![0.0; n * inter], vec![0.0; n * inter]);
        qmatmul(gate.rows_view(e * inter, inter), &xs, &mut g);
        qmatmul(up.rows_view(e * inter, inter), &xs, &mut u);
        let dest = &mut expected[offsets[e] as usize * inter..][..n * inter];
        for ((d, g), u) in dest.iter_mut().zip(&g).zip(&u) {
            *d = silu(*g) * u;
        }
    }
    let name = format!("moe_gate_up ({tokens} tokens, {tile_count} tiles, bf16 out)");
    report.check(
        &name,
        rel_err(&download_bf16(gpu, &act, tokens * top_k * inter)?, &expected),
        TOL_Q4_BF16_OUT,
    );

    // Down: an independent bf16 input, out by entry with its routing weight.
    let down = random_q4(rng, experts * h, inter);
    let g_down = upload(gpu, &down)?;
    let (act_bits, act_in) = bf16_normals(rng, tokens * top_k * inter);
    gpu.upload(act.ptr(), &act_bits)?;
    let route_w: Vec<f32> = (0..tokens * top_k).map(|_| rng.uniform()).collect();
    let route_buf = gpu.upload_new(&route_w)?;
    let out = gpu.alloc(tokens * top_k * h)?;
    poison(gpu, &out)?;
    moe_down(l, act.ptr(), &sorted, route_buf.ptr(), &g_down, out.ptr())?;
    let mut expected = vec![0.0; tokens * top_k * h];
    for e in 0..experts {
        let first = offsets[e] as usize;
        let n = offsets[e + 1] as usize - first;
        if n == 0 {
            continue;
        }
        let mut y = vec![0.0; n * h];
        qmatmul(
            down.rows_view(e * h, h),
            &act_in[first * inter..(first + n) * inter],
            &mut y,
        );
        for (entry, row) in rows_of(e).zip(y.chunks(h)) {
            for (d, v) in expected[entry * h..][..h].iter_mut().zip(row) {
                *d = route_w[entry] * v;
            }
        }
    }
    let name = format!("moe_down ({tokens} tokens, {tile_count} tiles, weighted, by entry)");
    report.check(
        &name,
        rel_err(&download_f32(gpu, &out, tokens * top_k * h)?, &expected),
        TOL_Q4,
    );
    Ok(())
}
