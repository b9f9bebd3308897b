//! `lily selftest`'s checks of the prefill's matrix products (src/gemm.rs, kernels/gemm.cu) against lily_model's
//! qmatmul on the same bf16-rounded inputs.

use half::bf16;
use lily_model::cpu::linalg::{qmatmul, silu};
use lily_model::quant::{Blob, QMatrix, QView};
use lily_model::rng::Rng;
use lily_model::Config;

use super::{download, download_f32, normals, poison, rel_err, Report};
use crate::driver::{DevBuf, DevPtr, Gpu, Result};
use crate::gemm::{
    gemm_planned, max_tiles, moe_experts, moe_slots, plan, small_fits, wgmma_fits, Experts, Plan, SmallCodes, Sorted,
    K_STEP,
};
use crate::kernels::Kernels;
use crate::launch::Launcher;
use crate::weights::{upload, GpuMatrix};

// ---- `lily selftest`: the products against lily_model's qmatmul on the same bf16-rounded inputs ----
//
// Tolerances (max error over max |reference|). The 4-bit weights reach the tensor cores rounded to bf16 once
// (scale * q + bias, relative error <= 2^-9 each); the activations are exact and the sums f32, so the error
// is a sum of independent weight roundings, a few 1e-3 of the largest output on random data at k = 128 .. 4096.
// f32 outputs: 5e-3. bf16 outputs (SwiGLU) add their own rounding (2^-9 of each
// value) to that: 1e-2. The 8-bit path splits each weight into bf16 hi + lo (error ~2^-17) and leaves only
// f32 summation: 1e-4. The grouped products' small tiling takes exact weights and activations to two 8-bit digits
// (each input within 2^-16 of its group's largest), so the same tolerances hold with room; its codes of a given
// input are the CPU twin's bit for bit.

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

/// The real model's hidden width and shared expert width.
const FULL_HIDDEN: usize = 2048;
const FULL_SHARED_INTER: usize = 512;

/// Row counts of the short products: one row, a few, around the 16-row fragment and the 64-row tile, and the
/// batched step's larger sizes.
const SHORT_ROWS: [usize; 8] = [1, 3, 8, 16, 17, 64, 100, 256];

/// Every plan a `bits`-bit product of m rows (n weight rows, `k_steps` steps of k) can be launched with: whole-k tiles
/// of each height m allows (on wgmma each of its widths); k in 2 and 3 parts (uneven where the steps are not a multiple
/// of 3) and in one part a step, where the split kernels' slots hold them; where the small tiling takes the product, it
/// with k whole and in 3 parts and in one part a piece; and the plan `gemm` picks on this GPU.
fn plans(kernels: &Kernels, sms: usize, bits: u32, m: usize, n: usize, k_steps: usize) -> Vec<Plan> {
    let col_blocks = n.div_ceil(256);
    let mut plans = vec![Plan::Tiles(64)];
    if m > 64 {
        plans.push(Plan::Tiles(128));
        if wgmma_fits(kernels, bits) {
            plans.extend([256, 192, 128].map(Plan::Wgmma));
        }
    }
    let tiles = m.div_ceil(kernels.constant("gemm_split_rows")) * col_blocks;
    for parts in [2, 3, k_steps] {
        let fits = tiles * parts <= kernels.constant("gemm_split_blocks");
        if parts >= 2 && parts <= k_steps && fits && !plans.contains(&Plan::Split(parts)) {
            plans.push(Plan::Split(parts));
        }
    }
    let pieces = k_steps / 2;
    if small_fits(kernels, bits, m, k_steps * K_STEP) {
        for parts in [1, 3, pieces] {
            for cols in [256, 128] {
                let fits = tiles * parts <= kernels.constant("gemm_split_blocks");
                if parts <= pieces && fits && !plans.contains(&Plan::Small { parts, cols }) {
                    plans.push(Plan::Small { parts, cols });
                }
            }
        }
    }
    if m > 64 && wgmma_fits(kernels, bits) {
        for parts in [2, 3, k_steps] {
            let fits = tiles * parts <= kernels.constant("gemm_split_blocks");
            if parts <= k_steps && fits && !plans.contains(&Plan::WgmmaSplit(parts)) {
                plans.push(Plan::WgmmaSplit(parts));
            }
        }
    }
    let chosen = plan(kernels, bits, m, n, k_steps, sms);
    if !plans.contains(&chosen) {
        plans.push(chosen);
    }
    plans
}

fn plan_name(p: Plan) -> String {
    match p {
        Plan::Tiles(rows) => format!("{rows}-row tiles"),
        Plan::Wgmma(cols) => format!("128-row tiles of {cols} columns on wgmma"),
        Plan::WgmmaSplit(parts) => format!("128-row tiles on wgmma, k in {parts} parts"),
        Plan::Split(parts) => format!("k in {parts} parts"),
        Plan::Small { parts, cols } => format!("integer small tiling of {cols} columns, k in {parts} parts"),
    }
}

/// `lily selftest`'s checks of every product kernel (each plan the row count allows) against qmatmul.
pub(crate) fn check(gpu: &Gpu, kernels: &Kernels, config: &Config, seed: u64, report: &mut Report) -> Result<()> {
    let mut rng = Rng::new(seed ^ 0x9e33);
    let mut l = Launcher::new(gpu, kernels);
    let (h, inter, experts) = (config.hidden_size, config.moe_intermediate_size, config.num_experts);
    let sms = gpu.sm_count;

    // Dense products: odd and even n, partial tiles in m and n, k steps fewer than the pipeline's stages and not
    // a multiple of them or of the parts, every plan, with and without accumulate. Each matrix is checked at
    // several row counts: the first m rows of one input.
    let short = SHORT_ROWS.to_vec();
    // The dense kernels take k at run time, so the real model's widths (hidden 2048, attention output 4096, the
    // shared expert's 512) are checked whatever shape the kernels were compiled for.
    // Tiles that store their output by bulk copies (n a multiple of 4, k of 256 on Hopper) are among them, with and
    // without accumulate, from four k steps (fewer than the pipeline's stages) up: n = 640 leaves the last tile half
    // its columns, n = 300 a box of its output partly past n.
    let dense: [(Vec<usize>, usize, usize, u32, bool); 13] = [
        (short.clone(), h, 517, 4, false),
        (vec![130, 300], FULL_HIDDEN, 640, 4, false),
        (short.clone(), FULL_SHARED_INTER, 300, 4, false),
        (vec![200], 4 * K_STEP, 300, 4, true),
        (vec![7, 300], 2 * h, 300, 4, true),
        (vec![1, 17, 300], inter, 258, 4, true),
        (vec![64, 1000], 2 * h, 263, 4, true),
        (vec![1000], h + 3 * K_STEP, 640, 4, false),
        (vec![1, 16, 300], h, experts + 1, 8, true),
        (short.clone(), FULL_HIDDEN, 517, 4, false),
        (short.clone(), 2 * FULL_HIDDEN, 300, 4, true),
        (short.clone(), FULL_SHARED_INTER, 258, 4, true),
        (short.clone(), FULL_HIDDEN, 257, 8, false),
    ];
    for (ms, k, n, bits, accumulate) in dense {
        let max_m = *ms.iter().max().unwrap();
        let (a_bits, a) = bf16_normals(&mut rng, max_m * k);
        let w = QMatrix::quantize(&normals(&mut rng, n * k, 1.0), n, k, bits);
        let gw = upload(gpu, &w)?;
        let a_buf = gpu.upload_new(&a_bits)?;
        let mut expected = vec![0.0; max_m * n];
        qmatmul(w.view(), &a, &mut expected);
        let init = if accumulate {
            normals(&mut rng, max_m * n, 1.0)
        } else {
            vec![0.0; max_m * n]
        };
        expected.iter_mut().zip(&init).for_each(|(e, i)| *e += i);
        let out = gpu.alloc(max_m * n)?;
        for m in ms {
            for p in plans(kernels, sms, bits, m, n, k / K_STEP) {
                if accumulate {
                    gpu.upload(out.ptr(), &init[..m * n])?;
                } else {
                    poison(gpu, &out)?;
                }
                gemm_planned(&mut l, a_buf.ptr(), m, &gw, out.ptr(), accumulate, p)?;
                let name = format!(
                    "gemm_q{bits} m {m} k {k} n {n}, {}{}",
                    plan_name(p),
                    if accumulate { ", accumulate" } else { "" }
                );
                report.check(
                    &name,
                    rel_err(&download_f32(gpu, &out, m * n)?, &expected[..m * n]),
                    if bits == 8 { TOL_Q8 } else { TOL_Q4 },
                );
            }
        }
    }

    // The grouped expert products: one set of expert matrices, routings of few tokens (most experts empty, the
    // others one or two rows) and of many.
    let (gate, up) = (
        random_q4(&mut rng, experts * inter, h),
        random_q4(&mut rng, experts * inter, h),
    );
    let down = random_q4(&mut rng, experts * h, inter);
    let shared = [
        random_q4(&mut rng, inter, h),
        random_q4(&mut rng, inter, h),
        random_q4(&mut rng, h, inter),
    ];
    // On the GPU tiled, as the model's expert matrices are.
    let tiled = |m: &QMatrix| upload(gpu, m)?.tiled(gpu, kernels);
    let experts_q4 = MoeMatrices {
        g_gate: tiled(&gate)?,
        g_up: tiled(&up)?,
        g_down: tiled(&down)?,
        g_shared: [tiled(&shared[0])?, tiled(&shared[1])?, tiled(&shared[2])?],
        gate,
        up,
        down,
        shared,
    };
    // Every tiling at every token count: the small one (what up to 512 tokens take) and the large one.
    let small_rows = kernels.constant("moe_small_tile_rows");
    // (tile rows, whether the gate/up is moe_gate_up_rs's).
    let mut tilings = vec![(small_rows, false), (kernels.constant("moe_tile_rows"), false)];
    // On Hopper also the warpgroup gate/up's 128-row tiles (routings of moe_wgmma_min_tokens or more take them, or
    // moe_gate_up_rs's tiles from moe_rs_min_tokens on).
    if kernels.constant("moe_wgmma_built") == 1 {
        tilings.push((kernels.constant("moe_wgmma_tile_rows"), false));
    }
    if kernels.constant("moe_rs") == 1 {
        tilings.push((kernels.constant("moe_rs_tile_rows"), true));
    }
    // The small tiling's codes hold the routings it takes (`moe_small_max_tokens`, a tuning constant), so it is
    // checked up to there.
    let small_max = kernels.constant("moe_small_max_tokens");
    // moe_gate_up_rs's tiles also at a prompt's size (2,048 tokens: more tiles than SMs, so the persistent
    // moe_down_rs walks several items a block and its pipeline wraps).
    for tokens in [1, 3, 16, 300, 2048] {
        for &tiling in tilings
            .iter()
            .filter(|&&(rows, _)| rows != small_rows || tokens <= small_max)
            .filter(|&&(_, rs)| rs || tokens <= 300)
        {
            check_moe(&mut l, config, &experts_q4, tokens, tiling, &mut rng, report)?;
        }
    }
    gpu.sync()
}

/// The stacked expert matrices and the shared expert's gate, up and down, on the CPU and the GPU.
struct MoeMatrices {
    gate: QMatrix,
    up: QMatrix,
    down: QMatrix,
    shared: [QMatrix; 3],
    g_gate: GpuMatrix,
    g_up: GpuMatrix,
    g_down: GpuMatrix,
    g_shared: [GpuMatrix; 3],
}

impl MoeMatrices {
    fn experts(&self) -> Experts<'_> {
        Experts {
            gate: &self.g_gate,
            up: &self.g_up,
            down: &self.g_down,
            shared_gate: &self.g_shared[0],
            shared_up: &self.g_shared[1],
            shared_down: &self.g_shared[2],
        }
    }

    /// Expert e's rows of matrix `which` (0 gate, 1 up, 2 down); e = experts is the shared expert.
    fn rows(&self, which: usize, e: usize, experts: usize) -> QView<'_> {
        let stacked = [&self.gate, &self.up, &self.down][which];
        let rows = stacked.rows / experts;
        match e < experts {
            true => stacked.rows_view(e * rows, rows),
            false => self.shared[which].rows_view(0, rows),
        }
    }
}

/// The grouped expert products on a routing built here: every token picks TOP_K distinct experts, half the
/// tokens three "hot" ones among them (so some experts fill several whole tiles while most have a partial one),
/// and then the shared expert (number `experts`), as the routing kernel leaves them.
fn check_moe(
    l: &mut Launcher,
    config: &Config,
    m: &MoeMatrices,
    tokens: usize,
    (tile_rows, rs): (usize, bool),
    rng: &mut Rng,
    report: &mut Report,
) -> Result<()> {
    let gpu = l.gpu;
    let (h, inter, experts, top_k, slots) = (
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
        moe_slots(config),
    );
    let hot = [1, experts / 2, experts - 1];
    let mut expert_of = Vec::with_capacity(tokens * slots);
    for _ in 0..tokens {
        let mut chosen: Vec<usize> = if rng.uniform() < 0.5 { hot.to_vec() } else { Vec::new() };
        while chosen.len() < top_k {
            let e = (rng.next_u64() % experts as u64) as usize;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        chosen.push(experts);
        expert_of.extend(chosen);
    }
    // Entries `token * slots + slot`, stably sorted by expert; tiles of up to `tile_rows` sorted entries.
    let groups = experts + 1;
    let mut offsets = vec![0i32; groups + 1];
    for &e in &expert_of {
        offsets[e + 1] += 1;
    }
    for e in 0..groups {
        offsets[e + 1] += offsets[e];
    }
    let mut entries: Vec<i32> = (0..(tokens * slots) as i32).collect();
    entries.sort_by_key(|&entry| expert_of[entry as usize]);
    let mut tiles = Vec::new();
    for e in 0..groups {
        let (start, end) = (offsets[e] as usize, offsets[e + 1] as usize);
        tiles.extend(
            (start..end)
                .step_by(tile_rows)
                .flat_map(|first| [e as i32, first as i32]),
        );
    }
    let tile_count = tiles.len() / 2;
    let max_tiles = max_tiles(config, tokens, tile_rows);
    // Slots past the count hold a tile that would overwrite rows of other experts, were it run.
    tiles.resize(max_tiles * 2, 0);
    for slot in tile_count..max_tiles {
        tiles[2 * slot] = experts as i32 - 1;
    }
    let entries_buf = gpu.upload_new(&entries)?;
    let offsets_buf = gpu.upload_new(&offsets)?;
    let tiles_buf = gpu.upload_new(&tiles)?;
    let count_buf = gpu.upload_new(&[tile_count as i32])?;
    let work = gpu.upload_new(&vec![0i32; 1 + max_tiles])?;
    let sorted = Sorted {
        entries: entries_buf.ptr(),
        tiles: tiles_buf.ptr(),
        tile_count: count_buf.ptr(),
        offsets: offsets_buf.ptr(),
        work: work.ptr(),
        max_tiles,
        tile_rows,
        tokens,
        slots,
        rs,
    };
    let small = sorted.small(l.kernels);
    let rows_of = |e: usize| {
        entries[offsets[e] as usize..offsets[e + 1] as usize]
            .iter()
            .map(|&entry| entry as usize)
    };

    // Both products in one call; each against its twin: gate/up's act by sorted index from x, then down from the
    // act the GPU wrote (bf16, or the small tiling's codes, as the down product reads it), by entry with its routing
    // weight.
    let (x_bits, x) = bf16_normals(rng, tokens * h);
    let x_buf = gpu.upload_new(&x_bits)?;
    let act = gpu.alloc::<bf16>(tokens * slots * inter)?;
    gpu.memset_u32(act.ptr(), NAN_BF16X2, act.bytes() / 4)?;
    let codes = SmallCodes::new(gpu, l.kernels, config, tokens)?;
    poison(gpu, &codes.act_pairs)?;
    let route_w: Vec<f32> = (0..tokens * slots).map(|_| rng.uniform()).collect();
    let route_buf = gpu.upload_new(&route_w)?;
    let out = gpu.alloc(tokens * slots * h)?;
    poison(gpu, &out)?;
    moe_experts(
        l,
        x_buf.ptr(),
        DevPtr::NULL,
        &sorted,
        route_buf.ptr(),
        &m.experts(),
        act.ptr(),
        &codes,
        false,
        out.ptr(),
    )?;
    if small {
        let (want, _) = quantize_q8x2(&x);
        let got = download::<u32>(gpu, &codes.x_codes, want.len())?;
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        let name = format!("moe_quantize_rows ({tokens} rows): codes as the CPU's");
        report.check_eq(&name, differ == 0, &format!("{differ} of {} words differ", want.len()));
    }
    let mut expected = vec![0.0; tokens * slots * inter];
    for e in 0..groups {
        let xs: Vec<f32> = rows_of(e)
            .flat_map(|entry| x[entry / slots * h..][..h].iter().copied())
            .collect();
        let n = xs.len() / h;
        if n == 0 {
            continue;
        }
        let (mut g, mut u) = (vec![0.0; n * inter], vec![0.0; n * inter]);
        qmatmul(m.rows(0, e, experts), &xs, &mut g);
        qmatmul(m.rows(1, e, experts), &xs, &mut u);
        let dest = &mut expected[offsets[e] as usize * inter..][..n * inter];
        for ((d, g), u) in dest.iter_mut().zip(&g).zip(&u) {
            *d = silu(*g) * u;
        }
    }
    let kernel = match (rs, l.kernels.constant("moe_rs_narrow") == 1) {
        (true, true) => ", weights in registers, narrower tiles on 16, 32 or 64 rows",
        (true, false) => ", weights in registers",
        _ => "",
    };
    let name = format!("moe gate/up ({tokens} tokens, {tile_count} tiles of {tile_rows}{kernel})");
    let act_in = match small {
        true => dequantize_q8x2(
            &download::<u32>(gpu, &codes.act_codes, tokens * slots * inter / 2)?,
            &download_f32(gpu, &codes.act_pairs, tokens * slots * inter / K_STEP * 2)?,
        ),
        false => download_bf16(gpu, &act, tokens * slots * inter)?,
    };
    report.check(&name, rel_err(&act_in, &expected), TOL_Q4_BF16_OUT);

    let mut expected = vec![0.0; tokens * slots * h];
    for e in 0..groups {
        let first = offsets[e] as usize;
        let n = offsets[e + 1] as usize - first;
        if n == 0 {
            continue;
        }
        let mut y = vec![0.0; n * h];
        qmatmul(
            m.rows(2, e, experts),
            &act_in[first * inter..(first + n) * inter],
            &mut y,
        );
        for (entry, row) in rows_of(e).zip(y.chunks(h)) {
            for (d, v) in expected[entry * h..][..h].iter_mut().zip(row) {
                *d = route_w[entry] * v;
            }
        }
    }
    // Down takes moe_gate_up_rs's tiles on mma.sync, or on moe_down_rs where the build has it on.
    let down_rs = rs && l.kernels.constant("moe_rs_down") == 1;
    let kernel = if down_rs { ", weights in registers" } else { "" };
    let name = format!("moe down ({tokens} tokens, {tile_count} tiles of {tile_rows}{kernel}, weighted, by entry)");
    report.check(
        &name,
        rel_err(&download_bf16(gpu, &out, tokens * slots * h)?, &expected),
        TOL_Q4_BF16_OUT,
    );
    Ok(())
}

/// How Q8x2 rows that a kernel wrote differ from the CPU twin's coding of the same rows (`rows`, the kernel's bf16
/// outputs widened): the words and the scales that differ (none may: both follow from the rows and the group's
/// largest magnitude alone), and the error of the groups' sums (added in another order).
pub(super) struct CodesAgainstTwin {
    pub words: usize,
    pub differ: usize,
    pub scales_differ: usize,
    pub sums_err: f64,
}

impl CodesAgainstTwin {
    pub(super) fn measure(gpu: &Gpu, codes: &DevBuf<u32>, pairs: &DevBuf<f32>, rows: &[f32]) -> Result<Self> {
        let (want_codes, want_pairs) = quantize_q8x2(rows);
        let got_codes = download(gpu, codes, want_codes.len())?;
        let got_pairs = download_f32(gpu, pairs, want_pairs.len())?;
        let sums = |p: &[f32]| p.iter().skip(1).step_by(2).copied().collect::<Vec<f32>>();
        Ok(CodesAgainstTwin {
            words: want_codes.len(),
            differ: got_codes.iter().zip(&want_codes).filter(|(a, b)| a != b).count(),
            scales_differ: (0..want_pairs.len())
                .step_by(2)
                .filter(|&i| got_pairs[i] != want_pairs[i])
                .count(),
            sums_err: rel_err(&sums(&got_pairs), &sums(&want_pairs)),
        })
    }

    /// Both measures over two sets of rows.
    pub(super) fn and(self, other: CodesAgainstTwin) -> CodesAgainstTwin {
        CodesAgainstTwin {
            words: self.words + other.words,
            differ: self.differ + other.differ,
            scales_differ: self.scales_differ + other.scales_differ,
            sums_err: self.sums_err.max(other.sums_err),
        }
    }

    /// The two checks of `what`'s codes: words and scales exact, sums within 1e-5.
    pub(super) fn report(&self, report: &mut Report, what: &str) {
        let (differ, scales_differ, words) = (self.differ, self.scales_differ, self.words);
        report.check_eq(
            &format!("{what}: Q8x2 codes and scales as the CPU's"),
            differ == 0 && scales_differ == 0,
            &format!("{differ} of {words} words, {scales_differ} scales differ"),
        );
        report.check(&format!("{what}: Q8x2 group sums"), self.sums_err, 1e-5);
    }
}

/// The CPU twin of the small tiling's Q8x2 rows (quantize_word_q8x2 in kernels/gemm.cu) for rows of whole groups:
/// 4 words an 8 inputs (digit 0's bytes of the even inputs, of the odd ones, then digit 1's) and a (scale / 128,
/// sum) pair a group of 64 inputs. (The sums are added in another order than on the GPU.)
pub(super) fn quantize_q8x2(x: &[f32]) -> (Vec<u32>, Vec<f32>) {
    let (mut codes, mut pairs) = (Vec::with_capacity(x.len() / 2), Vec::with_capacity(x.len() / 32));
    for group in x.chunks(K_STEP) {
        let mx = group.iter().fold(0f32, |m, v| m.max(v.abs()));
        let up = if mx > 0.0 { 127.0 / mx } else { 0.0 };
        for word in group.chunks(8) {
            let mut d = [[0u32; 2]; 2];
            for (i, &v) in word.iter().enumerate() {
                let y = v * up;
                let q0 = y.round_ties_even();
                let q1 = ((y - q0) * 128.0).round_ties_even();
                d[0][i & 1] |= (q0 as i32 as u32 & 0xff) << (8 * (i >> 1));
                d[1][i & 1] |= (q1 as i32 as u32 & 0xff) << (8 * (i >> 1));
            }
            codes.extend([d[0][0], d[0][1], d[1][0], d[1][1]]);
        }
        pairs.extend([mx / 127.0 / 128.0, group.iter().sum::<f32>()]);
    }
    (codes, pairs)
}

/// The inputs Q8x2 codes stand for: scale / 128 x (128 digit 0 + digit 1).
fn dequantize_q8x2(codes: &[u32], pairs: &[f32]) -> Vec<f32> {
    let digit = |word: u32, i: usize| (word >> (8 * (i >> 1))) as u8 as i8 as f32;
    codes
        .chunks(4)
        .enumerate()
        .flat_map(|(w, c)| {
            let s = pairs[2 * (w / (K_STEP / 8))];
            (0..8).map(move |i| s * (128.0 * digit(c[i & 1], i) + digit(c[2 + (i & 1)], i)))
        })
        .collect()
}
