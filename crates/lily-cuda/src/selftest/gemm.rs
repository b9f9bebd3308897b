//! `lily selftest`'s checks of the prefill's matrix products (src/gemm.rs, kernels/gemm.cu) against lily_model's
//! qmatmul on the same bf16-rounded inputs.

use half::bf16;
use lily_model::cpu::linalg::{qmatmul, silu};
use lily_model::quant::{Blob, QMatrix};
use lily_model::rng::Rng;
use lily_model::Config;

use super::{download_f32, normals, poison, rel_err, Report};
use crate::driver::{DevBuf, Gpu, Result};
use crate::gemm::{gemm_swiglu_tiles, gemm_tiles, max_tiles, moe_down, moe_gate_up, Sorted, K_STEP};
use crate::kernels::Kernels;
use crate::launch::Launcher;
use crate::weights::upload;

// ---- `lily selftest`: the products against lily_model's qmatmul on the same bf16-rounded inputs ----
//
// Tolerances (max error over max |reference|). The 4-bit weights reach the tensor cores rounded to bf16 once
// (scale * q + bias, relative error <= 2^-9 each); the activations are exact and the sums f32, so the error
// is a sum of independent weight roundings, a few 1e-3 of the largest output on random data at k = 128 .. 4096.
// f32 outputs: 5e-3. bf16 outputs (SwiGLU) add their own rounding (2^-9 of each
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
