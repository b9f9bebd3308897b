//! `lily selftest`'s checks of the prefill's glue kernels (kernels/prefill.cu) against their CPU twins.

use half::bf16;
use lily_model::cpu::linalg::{rmsnorm, sigmoid};
use lily_model::cpu::moe::{route, route_margin};
use lily_model::rng::Rng;

use super::{download, download_f32, normals, poison, rel_err, Report};
use crate::driver::{DevBuf, DevPtr, Gpu, Result};
use crate::gemm::moe_slots;
use crate::kernels::{gemm, prefill, Kernels, Q8x2};
use crate::launch::{Dims, Launcher};
use crate::prefill::{route_and_sort, route_and_sort_by, router_logits, PrefillScratch, RouterKernel, ROW_THREADS};
use crate::weights::GpuWeights;

/// `lily selftest`'s checks of the glue kernels against their CPU twins: embedding rows, RMSNorm rows (bf16 out:
/// tolerance 4e-3, half a bf16 step), routing (exact ids; weights 1e-5) with the stable sort by expert and its
/// tiles (exact), and the combine (1e-5: f32 sums in another order).
pub(crate) fn check(
    gpu: &Gpu,
    kernels: &Kernels,
    w: &lily_model::weights::Weights,
    gw: &GpuWeights,
    seed: u64,
    report: &mut Report,
) -> Result<()> {
    let c = &w.config;
    let (h, slots) = (c.hidden_size, moe_slots(c));
    let mut rng = Rng::new(seed ^ 0x9ef111);
    let t = 301;
    let mut l = Launcher::new(gpu, kernels);
    let l = &mut l;
    let s = PrefillScratch::new(gpu, kernels, c, t, t)?;
    let rows = Dims::linear(t as u32, ROW_THREADS);

    // Embedding rows.
    let tokens: Vec<i32> = (0..t + 3)
        .map(|_| (rng.next_u64() % c.vocab_size as u64) as i32)
        .collect();
    let tokens_buf = gpu.upload_new(&tokens)?;
    poison(gpu, &s.hidden)?;
    prefill::embed_rows(l, rows, tokens_buf.ptr(), 3, gw.embed_tokens.q4(), s.hidden.ptr())?;
    let mut expected = vec![0.0; t * h];
    for (r, row) in expected.chunks_mut(h).enumerate() {
        w.embed_tokens.view().dequantize_row(tokens[3 + r] as usize, row);
    }
    report.check(
        &format!("embed_rows ({t} tokens)"),
        rel_err(&download_f32(gpu, &s.hidden, t * h)?, &expected),
        1e-6,
    );

    // RMSNorm rows into bf16, and what the rounding lost (bf16 holds 8 significant bits, the two 16).
    let hidden = normals(&mut rng, t * h, 1.0);
    gpu.upload(s.hidden.ptr(), &hidden)?;
    poison(gpu, &s.normed)?;
    poison(gpu, &s.normed_lo)?;
    let norm = gw.layers[0].input_layernorm.ptr();
    let (normed, normed_lo) = (s.normed.ptr(), s.normed_lo.ptr());
    prefill::rmsnorm_rows(
        l,
        rows,
        s.hidden.ptr(),
        DevPtr::NULL,
        DevPtr::NULL,
        0,
        norm,
        normed,
        normed_lo,
        Q8x2::NONE,
    )?;
    let (mut hi, mut lo) = (vec![bf16::ZERO; t * h], vec![bf16::ZERO; t * h]);
    gpu.download(s.normed.ptr(), &mut hi)?;
    gpu.download(s.normed_lo.ptr(), &mut lo)?;
    let got: Vec<f32> = hi.iter().map(|v| v.to_f32()).collect();
    let both: Vec<f32> = hi.iter().zip(&lo).map(|(a, b)| a.to_f32() + b.to_f32()).collect();
    let mut expected = vec![0.0; t * h];
    for (x, out) in hidden.chunks(h).zip(expected.chunks_mut(h)) {
        rmsnorm(x, &w.layers[0].input_layernorm, c.rms_norm_eps, out);
    }
    report.check(
        &format!("rmsnorm_rows ({t} rows, bf16 out)"),
        rel_err(&got, &expected),
        4e-3,
    );
    report.check(
        &format!("rmsnorm_rows ({t} rows, bf16 out + what rounding lost)"),
        rel_err(&both, &expected),
        2e-5,
    );
    check_norm_coding(l, &s, norm, (t, h), report)?;

    check_router(l, w, gw, &s, &mut rng, report)?;

    // Routing, the stable sort by expert and the tiles, at a short prompt's and a batched step's token counts too,
    // on both sides of moe_route_sort's limit.
    // Above that limit, moe_sort both from route_rows' bits and by its pass over every entry.
    for t in [1, 13, 16, 17, 64, t] {
        check_routing(gpu, l, c, &s, t, false, &mut rng, report)?;
        if t > l.kernels.constant("route_sort_max_tokens") {
            check_routing(gpu, l, c, &s, t, true, &mut rng, report)?;
        }
    }
    for t in [17, 200, t] {
        check_sort_repeated(gpu, l, c, &s, t, &mut rng, report)?;
    }

    // Combine into the residual stream.
    // The expert rows are bf16; the sums over a token's slots f32.
    let expert_rows: Vec<bf16> = normals(&mut rng, t * slots * h, 1.0)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    gpu.upload(s.expert_out.ptr(), &expert_rows)?;
    let expert_out: Vec<f32> = expert_rows.iter().map(|v| v.to_f32()).collect();
    gpu.upload(s.hidden.ptr(), &hidden)?;
    prefill::moe_combine(l, rows, s.hidden.ptr(), s.expert_out.ptr())?;
    let expected: Vec<f32> = (0..t * h)
        .map(|i| {
            let (r, col) = (i / h, i % h);
            hidden[i] + (0..slots).map(|j| expert_out[(r * slots + j) * h + col]).sum::<f32>()
        })
        .collect();
    let combined = download_f32(gpu, &s.hidden, t * h)?;
    report.check(
        "moe_combine (weighted routed and shared outputs + residual)",
        rel_err(&combined, &expected),
        1e-5,
    );
    // The same rows added by the next norm (the forward passes' way): the residual stream and the normed rows must
    // be bit for bit what moe_combine and then the norm give.
    let norm = gw.layers[0].input_layernorm.ptr();
    let hidden_ptr = s.hidden.ptr();
    prefill::rmsnorm_rows(
        l,
        rows,
        hidden_ptr,
        DevPtr::NULL,
        DevPtr::NULL,
        0,
        norm,
        normed,
        DevPtr::NULL,
        Q8x2::NONE,
    )?;
    let mut separate = vec![bf16::ZERO; t * h];
    gpu.download(s.normed.ptr(), &mut separate)?;
    gpu.upload(s.hidden.ptr(), &hidden)?;
    poison(gpu, &s.normed)?;
    prefill::rmsnorm_rows(
        l,
        rows,
        hidden_ptr,
        s.expert_out.ptr(),
        DevPtr::NULL,
        0,
        norm,
        normed,
        DevPtr::NULL,
        Q8x2::NONE,
    )?;
    let fused_hidden = download_f32(gpu, &s.hidden, t * h)?;
    let mut fused = vec![bf16::ZERO; t * h];
    gpu.download(s.normed.ptr(), &mut fused)?;
    let (same, found) = same_rows((&fused_hidden, &combined), (&fused, &separate));
    report.check_eq(
        "rmsnorm_rows adding the MoE rows == moe_combine, then rmsnorm_rows",
        same,
        &found,
    );
    for m in [16, 64] {
        check_norm_adding_parts(l, gw, &s, m, &hidden, &mut rng, report)?;
    }
    gpu.sync()
}

/// rmsnorm_rows adding the parts of k that a split output projection left in the slots must give, bit for bit,
/// the residual rows and normed rows that the product's own sum (gemm_split_sum) and then the norm give. The
/// projection: the first layer's, on m random rows (a batched step's; the small tiling cuts k at 16 and 64 rows at
/// both of the selftest's shapes, which the check requires).
fn check_norm_adding_parts(
    l: &mut Launcher,
    gw: &GpuWeights,
    s: &PrefillScratch,
    m: usize,
    hidden: &[f32],
    rng: &mut Rng,
    report: &mut Report,
) -> Result<()> {
    let gpu = l.gpu;
    let layer = &gw.layers[0];
    let w = match &layer.mixer {
        crate::weights::GpuMixer::Linear(g) => &g.out_proj,
        crate::weights::GpuMixer::Full(a) => &a.o_proj,
    };
    let (h, k) = (w.rows, w.cols);
    let input: Vec<bf16> = normals(rng, m * k, 1.0).into_iter().map(bf16::from_f32).collect();
    let input_buf = gpu.upload_new(&input)?;
    let rows = Dims::linear(m as u32, ROW_THREADS);
    let norm = layer.post_attention_layernorm.ptr();
    let mut run = |leave: bool| -> Result<(usize, Vec<f32>, Vec<bf16>)> {
        gpu.upload(s.hidden.ptr(), &hidden[..m * h])?;
        poison(gpu, &s.normed)?;
        let parts = match leave {
            true => crate::gemm::gemm_coded_leaving_parts(l, input_buf.ptr(), m, w, s.hidden.ptr(), false)?,
            false => crate::gemm::gemm(l, input_buf.ptr(), m, w, s.hidden.ptr(), true).map(|()| 0)?,
        };
        let partials = l.kernels.buffer("gemm_partials");
        prefill::rmsnorm_rows(
            l,
            rows,
            s.hidden.ptr(),
            DevPtr::NULL,
            partials,
            parts as i32,
            norm,
            s.normed.ptr(),
            DevPtr::NULL,
            Q8x2::NONE,
        )?;
        let mut normed = vec![bf16::ZERO; m * h];
        gpu.download(s.normed.ptr(), &mut normed)?;
        Ok((parts, download_f32(gpu, &s.hidden, m * h)?, normed))
    };
    let (parts, fused_hidden, fused) = run(true)?;
    let (_, summed_hidden, separate) = run(false)?;
    let (same, found) = same_rows((&fused_hidden, &summed_hidden), (&fused, &separate));
    report.check_eq(
        &format!("rmsnorm_rows adding an output projection's {parts} parts of k ({m} rows) == gemm_split_sum, then rmsnorm_rows"),
        parts > 1 && same,
        &format!("{parts} parts left; {found}"),
    );
    Ok(())
}

/// rmsnorm_rows coding its rows as Q8x2 as it writes them (the small tiling's input without a launch of its own)
/// must give, bit for bit, what the separate coding kernel gives from the rows it stored: with what the rounding
/// lost (the experts' input) and without it (a dense product's). `s.hidden` holds the t rows of h inputs to norm.
fn check_norm_coding(
    l: &mut Launcher,
    s: &PrefillScratch,
    norm: DevPtr<f32>,
    (t, h): (usize, usize),
    report: &mut Report,
) -> Result<()> {
    let gpu = l.gpu;
    let alloc = || -> Result<(DevBuf<u32>, DevBuf<f32>)> { Ok((gpu.alloc(t * h / 2)?, gpu.alloc(t * h / 32)?)) };
    let (fused, separate) = (alloc()?, alloc()?);
    let q8x2 = |b: &(DevBuf<u32>, DevBuf<f32>)| Q8x2 {
        codes: b.0.ptr(),
        pairs: b.1.ptr(),
    };
    let rows = Dims::linear(t as u32, ROW_THREADS);
    let words = Dims::linear((t * h / 8).div_ceil(256) as u32, 256);
    for (lo, what) in [
        (s.normed_lo.ptr(), "bf16 + what rounding lost"),
        (DevPtr::NULL, "the bf16 rows"),
    ] {
        for b in [&fused, &separate] {
            poison(gpu, &b.0)?;
            poison(gpu, &b.1)?;
        }
        prefill::rmsnorm_rows(
            l,
            rows,
            s.hidden.ptr(),
            DevPtr::NULL,
            DevPtr::NULL,
            0,
            norm,
            s.normed.ptr(),
            lo,
            q8x2(&fused),
        )?;
        gemm::moe_quantize_rows(l, words, s.normed.ptr(), lo, t as i32, q8x2(&separate))?;
        let same_codes = download(gpu, &fused.0, fused.0.len())? == download(gpu, &separate.0, separate.0.len())?;
        let bits = |b: &DevBuf<f32>| -> Result<Vec<u32>> {
            Ok(download(gpu, b, b.len())?.iter().map(|v| v.to_bits()).collect())
        };
        let same_pairs = bits(&fused.1)? == bits(&separate.1)?;
        report.check_eq(
            &format!("rmsnorm_rows coding its rows as Q8x2 == moe_quantize_rows after it ({what})"),
            same_codes && same_pairs,
            &format!("codes {}, pairs {}", bits_word(same_codes), bits_word(same_pairs)),
        );
    }
    Ok(())
}

/// Whether a fused kernel's residual rows and normed rows are bit for bit those of the separate kernels (`(fused,
/// separate)` each), and the finding in words.
fn same_rows(hidden: (&[f32], &[f32]), normed: (&[bf16], &[bf16])) -> (bool, String) {
    let same_hidden = hidden.0.iter().zip(hidden.1).all(|(a, b)| a.to_bits() == b.to_bits());
    let same_normed = normed.0.iter().zip(normed.1).all(|(a, b)| a.to_bits() == b.to_bits());
    let found = format!(
        "residual rows {}, normed rows {}",
        bits_word(same_hidden),
        bits_word(same_normed)
    );
    (same_hidden && same_normed, found)
}

fn bits_word(same: bool) -> &'static str {
    if same {
        "bit for bit"
    } else {
        "DIFFER"
    }
}

/// Token counts of the router check: one token, a few, a tile of 16 and one past it, the batched step's sizes, and a
/// prompt's chunk of 300 (not a whole tile).
const ROUTER_TOKENS: [usize; 8] = [1, 3, 16, 17, 64, 200, 256, 300];

/// Tolerance of the router's logits (max error over max |reference|). `router_rows` takes each 8-bit code and both
/// parts of the input exactly and sums their products in f32, scaled once a group of 64: 1e-5.
const TOL_ROUTER_ROWS: f64 = 1e-5;

/// The router's logits of layer 0 over the normed rows the RMSNorm left in `s.normed` and `s.normed_lo`, at every
/// count of `ROUTER_TOKENS`, against an f64 twin of the same input (the bf16 part plus the remainder) and the
/// dequantized router and shared gate rows; rows past the count must stay unwritten. Then the routing of those
/// logits on the GPU against the twin's: the same top-k experts for every token, except where the twin's margin
/// between the k-th and the next expert is within the logits' tolerance (a tie either order may break).
fn check_router(
    l: &mut Launcher,
    w: &lily_model::weights::Weights,
    gw: &GpuWeights,
    s: &PrefillScratch,
    rng: &mut Rng,
    report: &mut Report,
) -> Result<()> {
    let gpu = l.gpu;
    let c = &w.config;
    let (h, e, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
    let max_t = *ROUTER_TOKENS.iter().max().unwrap();
    assert!(max_t < s.chunk, "the scratch holds a row past the longest count");
    // The RMSNorm's rows of fresh inputs, as the MoE block makes them.
    gpu.upload(s.hidden.ptr(), &normals(rng, s.chunk * h, 1.0))?;
    let norm = gw.layers[0].post_attention_layernorm.ptr();
    let rows = Dims::linear(s.chunk as u32, ROW_THREADS);
    let (normed, normed_lo) = (s.normed.ptr(), s.normed_lo.ptr());
    prefill::rmsnorm_rows(
        l,
        rows,
        s.hidden.ptr(),
        DevPtr::NULL,
        DevPtr::NULL,
        0,
        norm,
        normed,
        normed_lo,
        Q8x2::NONE,
    )?;
    let (mut hi, mut lo) = (vec![bf16::ZERO; max_t * h], vec![bf16::ZERO; max_t * h]);
    gpu.download(s.normed.ptr(), &mut hi)?;
    gpu.download(s.normed_lo.ptr(), &mut lo)?;
    let x: Vec<f64> = hi
        .iter()
        .zip(&lo)
        .map(|(a, b)| a.to_f32() as f64 + b.to_f32() as f64)
        .collect();

    // The twin: the router's rows, then the shared expert's gate, dequantized; f64 sums.
    let moe = &w.layers[0].moe;
    let mut weights = vec![0.0f32; (e + 1) * h];
    for r in 0..e {
        moe.router.view().dequantize_row(r, &mut weights[r * h..][..h]);
    }
    moe.shared_expert_gate
        .view()
        .dequantize_row(0, &mut weights[e * h..][..h]);
    let expected: Vec<f32> = (0..max_t * (e + 1))
        .map(|i| {
            let (t, r) = (i / (e + 1), i % (e + 1));
            let row = &weights[r * h..][..h];
            row.iter()
                .zip(&x[t * h..][..h])
                .map(|(w, x)| *w as f64 * x)
                .sum::<f64>() as f32
        })
        .collect();

    // The logits of the first token at each count, which must not depend on the count.
    let mut first_rows: Vec<(usize, Vec<f32>)> = Vec::new();
    for t in ROUTER_TOKENS {
        poison(gpu, &s.router_logits)?;
        let (normed, normed_lo, logits) = (s.normed.ptr(), s.normed_lo.ptr(), s.router_logits.ptr());
        let router = &gw.layers[0].router;
        router_logits(l, c, router, normed, normed_lo, t, logits, RouterKernel::Rows)?;
        let got = download_f32(gpu, &s.router_logits, (t + 1) * (e + 1))?;
        let (kernel, tol) = ("router_rows", TOL_ROUTER_ROWS);
        first_rows.push((t, got[..e + 1].to_vec()));
        let err = rel_err(&got[..t * (e + 1)], &expected[..t * (e + 1)]);
        report.check(&format!("{kernel} ({t} tokens, {} rows, k {h})", e + 1), err, tol);
        report.check_eq(
            &format!("{kernel} ({t} tokens): rows past the last untouched"),
            got[t * (e + 1)..].iter().all(|v| v.is_nan()),
            "",
        );
        // The long prompts' kernels (several strips a block; a block's inputs staged): the same bits, and no row
        // past the count written.
        for (kernel, name) in [
            (RouterKernel::Tall, "router_rows_tall"),
            (RouterKernel::Wide, "router_rows_wide"),
        ] {
            poison(gpu, &s.router_logits)?;
            router_logits(l, c, router, normed, normed_lo, t, logits, kernel)?;
            let other = download_f32(gpu, &s.router_logits, (t + 1) * (e + 1))?;
            let differ = (0..t * (e + 1))
                .filter(|&i| other[i].to_bits() != got[i].to_bits())
                .count();
            report.check_eq(
                &format!("{name} ({t} tokens): logits equal router_rows' bit for bit, rows past untouched"),
                differ == 0 && other[t * (e + 1)..].iter().all(|v| v.is_nan()),
                &format!("{differ} of {} logits differ", t * (e + 1)),
            );
        }

        // The routing of these logits, GPU against the twin's.
        route_and_sort(l, c, s, t)?;
        let slots = moe_slots(c);
        let mut gpu_ids = vec![0i32; t * slots];
        gpu.download(s.route_ids.ptr(), &mut gpu_ids)?;
        let scale = expected[..t * (e + 1)].iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (mut differ, mut near_ties) = (0, 0);
        for r in 0..t {
            let twin_logits = &expected[r * (e + 1)..][..e];
            let (mut ids, mut route_w) = (vec![0usize; k], vec![0.0f32; k]);
            route(twin_logits, k, &mut ids, &mut route_w);
            let row_max = twin_logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let near_tie = route_margin(twin_logits, &ids) * row_max <= 2.0 * tol as f32 * scale;
            near_ties += near_tie as usize;
            let same = gpu_ids[r * slots..][..k]
                .iter()
                .zip(&ids)
                .all(|(a, b)| *a as usize == *b);
            differ += (!same && !near_tie) as usize;
        }
        report.check_eq(
            &format!("{kernel} ({t} tokens) then the routing: top-k as the twin's"),
            differ == 0,
            &format!("{differ} tokens differ, {near_ties} near-ties excused"),
        );
    }
    let (t0, row0) = &first_rows[0];
    let differ: Vec<usize> = first_rows.iter().filter(|(_, r)| r != row0).map(|(t, _)| *t).collect();
    report.check_eq(
        &format!("router_rows: the first token's logits at {t0} tokens and every larger count, bit for bit"),
        differ.is_empty(),
        &format!("differ at {differ:?} tokens"),
    );
    Ok(())
}

/// moe_sort where some tokens hold an expert in two slots (route() never leaves such a routing, but moe_sort must
/// not depend on it): that expert's bits count such a token once, fewer than its count, so the block must find its
/// entries by a pass over all of them. The routing is written here as route_rows would leave it (ids, counts, bits),
/// and the entries must come out stably sorted by expert with their offsets.
fn check_sort_repeated(
    gpu: &Gpu,
    l: &mut Launcher,
    c: &lily_model::Config,
    s: &PrefillScratch,
    t: usize,
    rng: &mut Rng,
    report: &mut Report,
) -> Result<()> {
    let (e, k, slots) = (c.num_experts, c.num_experts_per_tok, moe_slots(c));
    let mask_words = t.div_ceil(32);
    let mut ids = vec![0usize; t * slots];
    for r in 0..t {
        // k distinct routed experts from a random start, then the shared one.
        let first = rng.next_u64() as usize % e;
        (0..k).for_each(|j| ids[r * slots + j] = (first + j) % e);
        ids[r * slots + k] = e;
        // Every fifth token holds its second expert again in its last routed slot.
        if r % 5 == 0 {
            ids[r * slots + k - 1] = ids[r * slots + 1];
        }
    }
    let mut words = vec![0i32; e + 1 + s.work_len() + e * mask_words];
    for r in 0..t {
        for j in 0..slots {
            let id = ids[r * slots + j];
            words[id] += 1;
            if j < k {
                words[e + 1 + s.work_len() + id * mask_words + r / 32] |= (1u32 << (r % 32)) as i32;
            }
        }
    }
    let route_ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    gpu.upload(s.route_ids.ptr(), &route_ids)?;
    gpu.upload(s.counts.ptr(), &words)?;
    poison(gpu, &s.entries)?;
    let tile_rows = crate::gemm::moe_tile_rows(l.kernels, t);
    prefill::moe_sort(
        l,
        Dims::linear((e + 1) as u32, 256),
        s.route_ids.ptr(),
        t as i32,
        s.counts.ptr(),
        s.masks(c),
        mask_words as i32,
        tile_rows as i32,
        s.offsets.ptr(),
        s.entries.ptr(),
        s.tiles.ptr(),
        s.tile_count.ptr(),
    )?;
    let mut order: Vec<usize> = (0..t * slots).collect();
    order.sort_by_key(|&i| ids[i]);
    let mut offsets = vec![0i32; e + 2];
    for x in 0..=e {
        offsets[x + 1] = offsets[x] + words[x];
    }
    let mut gpu_entries = vec![0i32; t * slots];
    gpu.download(s.entries.ptr(), &mut gpu_entries)?;
    let mut gpu_offsets = vec![0i32; e + 2];
    gpu.download(s.offsets.ptr(), &mut gpu_offsets)?;
    report.check_eq(
        &format!("moe_sort: entries stably sorted by expert, an expert in two slots of a token ({t} tokens)"),
        gpu_entries.iter().zip(&order).all(|(a, b)| *a as usize == *b) && gpu_offsets == offsets,
        "",
    );
    Ok(())
}

/// Routing and the sort of `t` tokens' entries by expert (`route_and_sort_by`, `moe_sort` from the experts' bits
/// where `masks`) against the CPU twin: exact ids, weights within 1e-5, entries, offsets, tiles and counts exact,
/// and the small tiling's work counters after the counts zeroed.
#[allow(clippy::too_many_arguments)]
fn check_routing(
    gpu: &Gpu,
    l: &mut Launcher,
    c: &lily_model::Config,
    s: &PrefillScratch,
    t: usize,
    masks: bool,
    rng: &mut Rng,
    report: &mut Report,
) -> Result<()> {
    let (e, k, slots) = (c.num_experts, c.num_experts_per_tok, moe_slots(c));
    let kernels = l.kernels;
    // Every count and work counter -1, and every bit of the experts' masks set: route_and_sort must clear what it
    // uses.
    gpu.upload(s.counts.ptr(), &vec![-1i32; s.counts.len()])?;
    let mut logits = normals(rng, t * (e + 1), 2.0);
    // Logits that are not finite, in the first rows where there are three or more: all NaN (every expert ranks as
    // negative infinity: the lowest k, weights NaN), every other expert NaN, and all but three experts negative
    // infinity (k distinct experts still, the three finite ones first).
    if t >= 3 {
        logits[..e].fill(f32::NAN);
        (0..e).step_by(2).for_each(|x| logits[(e + 1) + x] = f32::NAN);
        logits[2 * (e + 1)..][3..e].fill(f32::NEG_INFINITY);
    }
    gpu.upload(s.router_logits.ptr(), &logits)?;
    poison(gpu, &s.route_w)?;
    poison(gpu, &s.entries)?;
    let tile_rows = crate::gemm::moe_tile_rows(kernels, t);
    route_and_sort_by(l, c, s, t, masks)?;
    // The kernels that ran: one block up to route_sort_max_tokens tokens, else the routing then the sort.
    let (route_name, sort_name) = if t <= kernels.constant("route_sort_max_tokens") {
        ("moe_route_sort", "moe_route_sort")
    } else if masks {
        ("route_rows (bits)", "moe_sort (bits)")
    } else {
        ("route_rows", "moe_sort")
    };
    // Each token's slots: its top-k experts, then the shared expert (number e) with its sigmoid gate.
    let (mut ids, mut weights) = (vec![0usize; t * slots], vec![0.0f32; t * slots]);
    for r in 0..t {
        let logits = &logits[r * (e + 1)..][..e + 1];
        route(
            &logits[..e],
            k,
            &mut ids[r * slots..][..k],
            &mut weights[r * slots..][..k],
        );
        ids[r * slots + k] = e;
        weights[r * slots + k] = sigmoid(logits[e]);
    }
    let mut gpu_ids = vec![0i32; t * slots];
    gpu.download(s.route_ids.ptr(), &mut gpu_ids)?;
    report.check_eq(
        &format!("{route_name}: top-k experts of every token, then the shared expert ({t} tokens)"),
        gpu_ids.iter().zip(&ids).all(|(a, b)| *a as usize == *b),
        "",
    );
    // The weights where the twin's are numbers (a row of NaN logits has NaN weights on both).
    let gpu_weights = download_f32(gpu, &s.route_w, t * slots)?;
    let (got_w, want_w): (Vec<f32>, Vec<f32>) = gpu_weights.iter().zip(&weights).filter(|(_, w)| !w.is_nan()).unzip();
    report.check(
        &format!("{route_name}: routing weights and the shared expert's gate ({t} tokens)"),
        rel_err(&got_w, &want_w),
        1e-5,
    );
    let mut order: Vec<usize> = (0..t * slots).collect();
    order.sort_by_key(|&i| ids[i]);
    // Entries an expert (the shared one last), from which the offsets and tiles follow.
    let mut expected_counts = vec![0i32; e + 1];
    ids.iter().for_each(|&i| expected_counts[i] += 1);
    let mut offsets = vec![0i32; e + 2];
    let mut tiles = Vec::new();
    for x in 0..=e {
        let n = expected_counts[x] as usize;
        offsets[x + 1] = offsets[x] + n as i32;
        tiles.extend((0..n.div_ceil(tile_rows)).flat_map(|j| [x as i32, offsets[x] + (j * tile_rows) as i32]));
    }
    let mut gpu_entries = vec![0i32; t * slots];
    gpu.download(s.entries.ptr(), &mut gpu_entries)?;
    let mut gpu_offsets = vec![0i32; e + 2];
    gpu.download(s.offsets.ptr(), &mut gpu_offsets)?;
    let mut gpu_count = [0i32];
    gpu.download(s.tile_count.ptr(), &mut gpu_count)?;
    let mut gpu_tiles = vec![0i32; tiles.len()];
    gpu.download(s.tiles.ptr(), &mut gpu_tiles)?;
    let sorted = gpu_entries.iter().zip(&order).all(|(a, b)| *a as usize == *b) && gpu_offsets == offsets;
    report.check_eq(
        &format!("{sort_name}: entries stably sorted by expert, offsets ({t} tokens)"),
        sorted,
        "",
    );
    report.check_eq(
        &format!("{sort_name}: tiles ({t} tokens)"),
        gpu_count[0] as usize * 2 == tiles.len() && gpu_tiles == tiles,
        &format!("{} tiles", tiles.len() / 2),
    );

    let mut counts = vec![0i32; s.counts.len()];
    gpu.download(s.counts.ptr(), &mut counts)?;
    report.check_eq(
        &format!("{route_name}: counts, and the work counters after them zeroed ({t} tokens)"),
        counts[..=e] == expected_counts[..] && counts[e + 1..][..s.work_len()].iter().all(|&v| v == 0),
        "",
    );
    Ok(())
}
