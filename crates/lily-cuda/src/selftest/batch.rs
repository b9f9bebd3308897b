//! `lily selftest`'s checks of the batched decode mixers (kernels/deltanet.cu, kernels/attention.cu) against their
//! CPU twins: a batch of rows, each a token of its own sequence slot at its own position, the slots taken in a
//! shuffled order and the KV pages of each slot scattered through the pools by a shuffled page table.

use half::{bf16, f16};
use lily_model::config::{LayerKind, GROUP_SIZE};
use lily_model::cpu::attention::{attend, rope};
use lily_model::cpu::deltanet::{conv_step, l2norm, recurrent_step};
use lily_model::cpu::linalg::{rmsnorm, rmsnorm_in_place, sigmoid, silu, softplus};
use lily_model::rng::Rng;
use lily_model::weights::{GatedDeltaNet, Mixer, Weights};
use lily_model::Config;

use super::gemm::CodesAgainstTwin;
use super::{download_f16, download_f32, normals, poison, rel_err, shuffled, to_f16, widen_f16, Report, F16_STATE_TOL};
use crate::batch::{attention_merge, attention_parts, AttentionParts};
use crate::driver::{DevBuf, DevPtr, Result};
use crate::kernels::{attention, deltanet, Q8x2, ATTN_SPLITS};

/// Parts the batched attention check splits each row's context into (fewer than ATTN_SPLITS, as a batched step
/// of many rows does).
const SPLITS: usize = 5;
use crate::launch::{Dims, Launcher};
use crate::model::CudaModel;
use crate::pages::{pages_for, KV_PAGE};
use crate::weights::GpuMixer;

/// Rows of the batch and sequence slots the checks use.
const ROWS: usize = 5;
const SLOTS: usize = 7;

/// CPU twin of one DeltaNet decode step: `proj` (q k v z b a) of the token at `position`, the conv ring (row
/// `p % taps` holds position p's input) and the recurrent state of its sequence; updates `state`, writes `core`.
pub(crate) fn deltanet_step_twin(
    c: &Config,
    d: &GatedDeltaNet,
    position: usize,
    proj: &[f32],
    ring: &[f32],
    state: &mut [f32],
    core: &mut [f32],
) {
    let (conv_dim, taps) = (c.linear_conv_dim(), c.linear_conv_kernel_dim);
    let (nk, nv, dk, dv) = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    );
    // The conv state oldest first, from the ring.
    let mut conv_state: Vec<f32> = (0..taps - 1)
        .flat_map(|j| ring[((position + 1 + j) % taps) * conv_dim..][..conv_dim].to_vec())
        .collect();
    let mut conv_out = vec![0.0; conv_dim];
    conv_step(&proj[..conv_dim], &mut conv_state, &d.conv1d, taps, &mut conv_out);
    let key_dim = nk * dk;
    for head in conv_out[..2 * key_dim].chunks_exact_mut(dk) {
        l2norm(head);
    }
    conv_out[..key_dim]
        .iter_mut()
        .for_each(|v| *v *= 1.0 / (dk as f32).sqrt());
    for head in 0..nv {
        let kh = head / (nv / nk);
        let beta = sigmoid(proj[conv_dim + nv * dv + head]);
        let decay = -d.a_log[head].exp() * softplus(proj[conv_dim + nv * dv + nv + head] + d.dt_bias[head]);
        recurrent_step(
            &conv_out[kh * dk..(kh + 1) * dk],
            &conv_out[key_dim + kh * dk..key_dim + (kh + 1) * dk],
            &conv_out[2 * key_dim + head * dv..2 * key_dim + (head + 1) * dv],
            decay,
            beta,
            &mut state[head * dk * dv..(head + 1) * dk * dv],
            &mut core[head * dv..(head + 1) * dv],
        );
    }
}

/// Positions of the rows: inside the first page, at a page's first position, a few pages in, thousands of
/// positions in, and past 256 x 64 (where the decode attention's parts start between pages and a tile of positions
/// spans five pages).
fn row_positions(rng: &mut Rng) -> [usize; ROWS] {
    let mut r = |n: u64| (rng.next_u64() % n) as usize;
    [r(64), 64 * (1 + r(3)), 300 + r(200), 1000 + r(3000), 20_000 + r(5000)]
}

pub(crate) fn check(model: &CudaModel, w: &Weights, seed: u64, report: &mut Report) -> Result<()> {
    let c = &model.config;
    let g = &model.gpu;
    let mut rng = Rng::new(seed ^ 0xba7c);
    let layer_of = |kind| {
        c.layer_types
            .iter()
            .position(|k| *k == kind)
            .expect("a layer of each kind")
    };
    let (first_linear, first_full) = (layer_of(LayerKind::Linear), layer_of(LayerKind::Full));
    let slots: Vec<i32> = shuffled(&mut rng, SLOTS)[..ROWS].to_vec();
    let positions = row_positions(&mut rng);
    let positions_i32: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
    let slots_buf = g.upload_new(&slots)?;
    let positions_buf = g.upload_new(&positions_i32)?;
    let mut l = Launcher::new(g, &model.kernels);
    let rows = ROWS as u32;
    println!("   batched decode ({ROWS} rows, slots {slots:?}, positions {positions:?}):");

    // DeltaNet step: its raw output rows, then (again from the same state) the gated norm it ends with.
    {
        let (Mixer::Linear(d), GpuMixer::Linear(gd)) =
            (&w.layers[first_linear].mixer, &model.weights.layers[first_linear].mixer)
        else {
            unreachable!("layer {first_linear} is a DeltaNet layer")
        };
        let (conv_dim, taps) = (c.linear_conv_dim(), c.linear_conv_kernel_dim);
        let (nv, dk, dv) = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (ring_len, state_len, v_dim) = (taps * conv_dim, nv * dk * dv, nv * dv);
        let proj_dim = conv_dim + v_dim + 2 * nv;
        let proj = normals(&mut rng, ROWS * proj_dim, 1.0);
        let ring = normals(&mut rng, SLOTS * ring_len, 1.0);
        let state_f16 = to_f16(&normals(&mut rng, SLOTS * state_len, 0.05));
        let proj_buf = g.upload_new(&proj)?;
        let ring_buf = g.upload_new(&ring)?;
        let state_buf = g.upload_new(&state_f16)?;
        let state = widen_f16(&state_f16);
        let core_buf = g.alloc::<f32>(ROWS * v_dim)?;
        poison(g, &core_buf)?;
        // With `normed` null the step writes its raw output rows; in the batched step it writes the gated norm.
        let step = |l: &mut Launcher, ring: &DevBuf<f32>, state: &DevBuf<f16>, normed, codes| {
            deltanet::deltanet_step_rows(
                l,
                Dims::new((nv as u32, 1, rows), 256),
                positions_buf.ptr(),
                slots_buf.ptr(),
                proj_buf.ptr(),
                ring.ptr(),
                gd.conv1d.ptr(),
                gd.a_log.ptr(),
                gd.dt_bias.ptr(),
                state.ptr(),
                core_buf.ptr(),
                gd.norm.ptr(),
                normed,
                codes,
            )
        };
        step(&mut l, &ring_buf, &state_buf, DevPtr::NULL, Q8x2::NONE)?;
        g.sync()?;
        let (mut expected_state, mut expected_ring) = (state.clone(), ring.clone());
        let mut expected_core = vec![0.0; ROWS * v_dim];
        for (b, (&slot, &position)) in slots.iter().zip(&positions).enumerate() {
            let s = slot as usize;
            let row_proj = &proj[b * proj_dim..(b + 1) * proj_dim];
            deltanet_step_twin(
                c,
                d,
                position,
                row_proj,
                &ring[s * ring_len..(s + 1) * ring_len],
                &mut expected_state[s * state_len..(s + 1) * state_len],
                &mut expected_core[b * v_dim..(b + 1) * v_dim],
            );
            let at = s * ring_len + (position % taps) * conv_dim;
            expected_ring[at..at + conv_dim].copy_from_slice(&row_proj[..conv_dim]);
        }
        let core = download_f32(g, &core_buf, ROWS * v_dim)?;
        report.check(
            "deltanet_step, batched: each row's output",
            rel_err(&core, &expected_core),
            1e-4,
        );
        // The slots no row names must come back unchanged, so the whole buffer is compared.
        report.check(
            "deltanet_step, batched: each slot's recurrent state",
            rel_err(&download_f16(g, &state_buf, SLOTS * state_len)?, &expected_state),
            F16_STATE_TOL,
        );
        report.check(
            "deltanet_step, batched: each slot's conv ring",
            rel_err(&download_f32(g, &ring_buf, SLOTS * ring_len)?, &expected_ring),
            0.0,
        );

        // The same step from the same state, ending with the gated norm, which also codes its rows as the small
        // tiling's Q8x2 rows (what out_proj reads where it takes that tiling); the core rows are not written then.
        let gpu_state = download_f16(g, &state_buf, SLOTS * state_len)?;
        let (ring_again, state_again) = (g.upload_new(&ring)?, g.upload_new(&state_f16)?);
        let out_buf = g.upload_new(&vec![bf16::NAN; ROWS * v_dim])?;
        let codes_buf = g.upload_new(&vec![0x5a5a_5a5a_u32; ROWS * v_dim / 2])?;
        let pairs_buf = g.upload_new(&vec![f32::NAN; ROWS * v_dim / GROUP_SIZE * 2])?;
        let codes = Q8x2 {
            codes: codes_buf.ptr(),
            pairs: pairs_buf.ptr(),
        };
        step(&mut l, &ring_again, &state_again, out_buf.ptr(), codes)?;
        g.sync()?;
        let same_state = download_f16(g, &state_again, SLOTS * state_len)? == gpu_state;
        report.check_eq(
            "deltanet_step, batched, with its gated norm: the same recurrent state",
            same_state,
            "bit for bit the state of the step without the norm",
        );
        let mut out = vec![bf16::ZERO; ROWS * v_dim];
        g.download(out_buf.ptr(), &mut out)?;
        let rows_f32: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
        CodesAgainstTwin::measure(g, &codes_buf, &pairs_buf, &rows_f32)?
            .report(report, "deltanet_step, batched: its gated norm's rows");
        let mut expected = expected_core.clone();
        for (b, row) in expected.chunks_exact_mut(v_dim).enumerate() {
            rmsnorm_in_place(row, &d.norm, c.rms_norm_eps);
            let z = &proj[b * proj_dim + conv_dim..b * proj_dim + conv_dim + v_dim];
            row.iter_mut().zip(z).for_each(|(o, z)| *o *= silu(*z));
        }
        let out: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
        // One bf16 rounding of each value (<= 2^-8 of it): at most 3.9e-3 of the largest, plus the step's own error
        // (within 1e-4 above).
        report.check(
            "deltanet_step, batched: its gated RMSNorm per head (bf16 rows)",
            rel_err(&out, &expected),
            5e-3,
        );
    }

    // Attention: prep into the paged pools, the split parts, the merge with the gate (f32 and bf16 rows).
    {
        let (Mixer::Full(a), GpuMixer::Full(ga)) =
            (&w.layers[first_full].mixer, &model.weights.layers[first_full].mixer)
        else {
            unreachable!("layer {first_full} is an attention layer")
        };
        let (heads, kv_heads, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let proj_dim = 2 * q_dim + 2 * kv_dim;
        let pages_per_seq = pages_for(positions.iter().max().expect("rows") + 1);
        let pool_pages = ROWS * pages_per_seq + 3;
        let page_len = KV_PAGE * kv_dim;
        // Every slot's row in the table; each row's slot gets the pages it needs from a shuffled pool, the
        // others none (their entries stay 0 and are never read).
        let order = shuffled(&mut rng, pool_pages);
        let mut table = vec![0i32; SLOTS * pages_per_seq];
        let mut next = 0;
        for (&slot, &position) in slots.iter().zip(&positions) {
            let n = pages_for(position + 1);
            table[slot as usize * pages_per_seq..][..n].copy_from_slice(&order[next..next + n]);
            next += n;
        }
        let at = |slot: i32, p: usize| {
            (table[slot as usize * pages_per_seq + p / KV_PAGE] as usize * KV_PAGE + p % KV_PAGE) * kv_dim
        };
        // NaN everywhere but each row's positions before its own, which hold random keys and values.
        let mut k_pool = vec![bf16::NAN; pool_pages * page_len];
        let mut v_pool = vec![bf16::NAN; pool_pages * page_len];
        for (&slot, &position) in slots.iter().zip(&positions) {
            for p in 0..position {
                for pool in [&mut k_pool, &mut v_pool] {
                    for x in &mut pool[at(slot, p)..at(slot, p) + kv_dim] {
                        *x = bf16::from_f32(rng.normal());
                    }
                }
            }
        }
        let proj = normals(&mut rng, ROWS * proj_dim, 1.0);
        let k_buf = g.upload_new(&k_pool)?;
        let v_buf = g.upload_new(&v_pool)?;
        let table_buf = g.upload_new(&table)?;
        let proj_buf = g.upload_new(&proj)?;
        let q_buf = g.alloc::<f32>(ROWS * q_dim)?;
        let part_o = g.alloc::<f32>(ROWS * heads * ATTN_SPLITS * hd)?;
        let part_ml = g.alloc::<f32>(ROWS * heads * ATTN_SPLITS * 2)?;
        let out_f32 = g.alloc::<f32>(ROWS * q_dim)?;
        let out_bf16 = g.upload_new(&vec![bf16::NAN; ROWS * q_dim])?;
        for buf in [&q_buf, &part_o, &part_ml, &out_f32] {
            poison(g, buf)?;
        }
        let pps = pages_per_seq as i32;
        attention::attn_prep(
            &mut l,
            Dims::new(((heads + kv_heads) as u32, 1, rows), hd as u32),
            positions_buf.ptr(),
            slots_buf.ptr(),
            proj_buf.ptr(),
            ga.q_norm.ptr(),
            ga.k_norm.ptr(),
            model.state.inv_freq.ptr(),
            q_buf.ptr(),
            k_buf.ptr(),
            v_buf.ptr(),
            table_buf.ptr(),
            pps,
        )?;
        let parts = AttentionParts {
            positions: positions_buf.ptr(),
            slots: slots_buf.ptr(),
            q: q_buf.ptr(),
            k_pool: k_buf.ptr(),
            v_pool: v_buf.ptr(),
            page_table: table_buf.ptr(),
            pages_per_seq: pps,
            part_o: part_o.ptr(),
            part_ml: part_ml.ptr(),
        };
        attention_parts(&mut l, &parts, ROWS, kv_heads, SPLITS as i32)?;
        attention::attn_merge(
            &mut l,
            Dims::new((heads as u32, (hd / 32) as u32, rows), 256),
            positions_buf.ptr(),
            SPLITS as i32,
            part_o.ptr(),
            part_ml.ptr(),
            proj_buf.ptr(),
            out_f32.ptr(),
            out_bf16.ptr(),
        )?;
        // The batched step's merge of these few parts (`attention_merge`: a warp per head slice) into bf16 alone,
        // also coded as the small tiling's Q8x2 rows (what o_proj reads where it takes that tiling).
        let step_bf16 = g.upload_new(&vec![bf16::NAN; ROWS * q_dim])?;
        let merge_codes_buf = g.upload_new(&vec![0x5a5a_5a5a_u32; ROWS * q_dim / 2])?;
        let merge_pairs_buf = g.upload_new(&vec![f32::NAN; ROWS * q_dim / GROUP_SIZE * 2])?;
        let merge_codes = Q8x2 {
            codes: merge_codes_buf.ptr(),
            pairs: merge_pairs_buf.ptr(),
        };
        let (merge_parts, step_bf16_ptr) = (SPLITS as i32, step_bf16.ptr());
        let coded = attention_merge(
            &mut l,
            c,
            ROWS,
            merge_parts,
            &parts,
            proj_buf.ptr(),
            step_bf16_ptr,
            merge_codes,
        )?;
        g.sync()?;
        let mut k_after = vec![bf16::ZERO; k_pool.len()];
        let mut v_after = vec![bf16::ZERO; v_pool.len()];
        g.download(k_buf.ptr(), &mut k_after)?;
        g.download(v_buf.ptr(), &mut v_after)?;
        let got_f32 = download_f32(g, &out_f32, ROWS * q_dim)?;
        let mut got_bf16 = vec![bf16::ZERO; ROWS * q_dim];
        g.download(out_bf16.ptr(), &mut got_bf16)?;
        let got_bf16: Vec<f32> = got_bf16.iter().map(|v| v.to_f32()).collect();
        let mut step_got = vec![bf16::ZERO; ROWS * q_dim];
        g.download(step_bf16.ptr(), &mut step_got)?;
        let step_got: Vec<f32> = step_got.iter().map(|v| v.to_f32()).collect();
        report.check_eq(
            "attention_merge, batched: codes its rows where o_proj takes the small tiling",
            coded,
            "attn_merge_rows took the codes",
        );
        CodesAgainstTwin::measure(g, &merge_codes_buf, &merge_pairs_buf, &step_got)?
            .report(report, "attention_merge, batched: its rows");

        let inv_freq = c.rope_inv_freq();
        let (mut new_k, mut want_k, mut new_v, mut want_v) = (vec![], vec![], vec![], vec![]);
        let mut expected = vec![0.0f32; ROWS * q_dim];
        let mut written = vec![false; k_pool.len()];
        for (b, (&slot, &position)) in slots.iter().zip(&positions).enumerate() {
            let row = &proj[b * proj_dim..(b + 1) * proj_dim];
            let mut q = vec![0.0; q_dim];
            for head in 0..heads {
                let qh = &mut q[head * hd..(head + 1) * hd];
                rmsnorm(&row[head * 2 * hd..head * 2 * hd + hd], &a.q_norm, c.rms_norm_eps, qh);
                rope(qh, position, &inv_freq);
            }
            let mut k = row[2 * q_dim..2 * q_dim + kv_dim].to_vec();
            for head in k.chunks_exact_mut(hd) {
                rmsnorm_in_place(head, &a.k_norm, c.rms_norm_eps);
                rope(head, position, &inv_freq);
            }
            let here = at(slot, position);
            written[here..here + kv_dim].iter_mut().for_each(|x| *x = true);
            new_k.extend(k_after[here..here + kv_dim].iter().map(|x| x.to_f32()));
            want_k.extend(k);
            new_v.extend(v_after[here..here + kv_dim].iter().map(|x| x.to_f32()));
            want_v.extend_from_slice(&row[2 * q_dim + kv_dim..]);
            // The sequence's keys and values as the GPU holds them, gathered through the table.
            let gather = |pool: &[bf16]| -> Vec<f32> {
                (0..=position)
                    .flat_map(|p| pool[at(slot, p)..at(slot, p) + kv_dim].iter().map(|x| x.to_f32()))
                    .collect()
            };
            let out = &mut expected[b * q_dim..(b + 1) * q_dim];
            attend(
                &q,
                &gather(&k_after),
                &gather(&v_after),
                position,
                heads,
                kv_heads,
                hd,
                out,
            );
            for head in 0..heads {
                for j in 0..hd {
                    out[head * hd + j] *= sigmoid(row[head * 2 * hd + hd + j]);
                }
            }
        }
        report.check(
            "attn_prep, batched: each row's key (k_norm, RoPE) in its page",
            rel_err(&new_k, &want_k),
            1e-2,
        );
        report.check(
            "attn_prep, batched: each row's value in its page",
            rel_err(&new_v, &want_v),
            1e-2,
        );
        let untouched = |before: &[bf16], after: &[bf16]| {
            before
                .iter()
                .zip(after)
                .zip(&written)
                .all(|((x, y), w)| *w || x.to_bits() == y.to_bits())
        };
        report.check_eq(
            "attn_prep, batched: nothing else in the pools written",
            untouched(&k_pool, &k_after) && untouched(&v_pool, &v_after),
            &format!("{pool_pages} pages"),
        );
        report.check(
            "attention, batched over shuffled pages (parts + merge + gate), f32",
            rel_err(&got_f32, &expected),
            1e-4,
        );
        // The same values rounded once to bf16 (<= 2^-8 of each).
        report.check(
            "attention, batched: the merge's bf16 rows",
            rel_err(&got_bf16, &expected),
            5e-3,
        );
        report.check(
            &format!("attention, batched: the step's merge of {SPLITS} parts (a warp per head slice), bf16"),
            rel_err(&step_got, &expected),
            5e-3,
        );
    }
    Ok(())
}
