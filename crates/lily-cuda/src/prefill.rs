//! The prefill: a prompt in chunks of up to `chunk` tokens, each chunk through the 40 layers at once. Here the
//! whole pass over a chunk is shown in order; the matrix products (4-bit weights, bf16 activations, tensor cores)
//! are in [`crate::gemm`], the DeltaNet and attention mixers in [`crate::prefill_gdn`] and [`crate::prefill_attn`],
//! the glue (embedding, norms, routing and sort, MoE combine) in kernels/prefill.cu.
//!
//! Activations: the residual stream stays f32; each product's input is rounded to bf16 once (after its RMSNorm
//! or gated norm). The KV cache, conv ring and recurrent state are the decode step's own buffers, so decode (or
//! the next chunk) continues where a chunk stops.

use half::bf16;
use lily_model::Config;

use crate::driver::{DevBuf, DevPtr, Gpu, Result};
use crate::gemm;
use crate::kernels::{prefill, Kernels};
use crate::launch::{Dims, Launcher};
use crate::model::DeviceState;
use crate::prefill_attn::AttnScratch;
use crate::prefill_gdn::GdnScratch;
use crate::weights::{GpuMixer, GpuWeights};

/// Tokens a chunk takes at most (activation memory grows linearly with it: ~200 kB a token at the full shape).
pub const PREFILL_CHUNK: usize = 8192;

const ROW_THREADS: u32 = 256;

/// A chunk's activations, allocated once for `chunk` tokens.
pub struct PrefillScratch {
    pub chunk: usize,
    /// f32 `[chunk][hidden]`: the residual stream.
    hidden: DevBuf<f32>,
    /// bf16 `[chunk][hidden]`: the normed input of the mixer's or the MoE's products.
    normed: DevBuf<bf16>,
    /// bf16 `[chunk][hidden]`: what rounding the MoE's normed input to bf16 lost (the router takes both).
    normed_lo: DevBuf<bf16>,
    /// bf16 `[chunk][max(linear value dim, q dim)]`: the mixer's output, input of its output projection.
    mixed: DevBuf<bf16>,
    /// f32 `[chunk][mixer input projection rows]`.
    proj: DevBuf<f32>,
    /// f32 `[chunk][experts + 1]`: router logits, then the shared expert's gate logit.
    router_logits: DevBuf<f32>,
    /// `[chunk * top_k]` by entry `token * top_k + slot`: expert ids (i32) and routing weights (f32).
    route_ids: DevBuf<i32>,
    route_w: DevBuf<f32>,
    /// f32 `[chunk]`: sigmoid of the shared expert's gate.
    shared_w: DevBuf<f32>,
    /// i32 `[experts]`, `[experts + 1]`, `[chunk * top_k]`, `[max_tiles][2]`, `[1]`: the sort by expert.
    counts: DevBuf<i32>,
    offsets: DevBuf<i32>,
    entries: DevBuf<i32>,
    tiles: DevBuf<i32>,
    tile_count: DevBuf<i32>,
    max_tiles: usize,
    /// bf16 `[chunk * top_k][moe inter]` by sorted entry; bf16 `[chunk][shared inter]`.
    act: DevBuf<bf16>,
    shared_act: DevBuf<bf16>,
    /// f32 `[chunk * top_k][hidden]` by entry; f32 `[chunk][hidden]`.
    expert_out: DevBuf<f32>,
    shared_out: DevBuf<f32>,
    gdn: GdnScratch,
    attn: AttnScratch,
}

impl PrefillScratch {
    pub fn new(gpu: &Gpu, kernels: &Kernels, c: &Config, chunk: usize) -> Result<PrefillScratch> {
        let (h, k) = (c.hidden_size, c.num_experts_per_tok);
        let proj_rows = (c.linear_conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads)
            .max(2 * c.q_dim() + 2 * c.kv_dim());
        let max_tiles = gemm::max_tiles(kernels, c, chunk);
        Ok(PrefillScratch {
            chunk,
            hidden: gpu.alloc(chunk * h)?,
            normed: gpu.alloc(chunk * h)?,
            normed_lo: gpu.alloc(chunk * h)?,
            mixed: gpu.alloc(chunk * c.linear_value_dim().max(c.q_dim()))?,
            proj: gpu.alloc(chunk * proj_rows)?,
            router_logits: gpu.alloc(chunk * (c.num_experts + 1))?,
            route_ids: gpu.alloc(chunk * k)?,
            route_w: gpu.alloc(chunk * k)?,
            shared_w: gpu.alloc(chunk)?,
            counts: gpu.alloc(c.num_experts)?,
            offsets: gpu.alloc(c.num_experts + 1)?,
            entries: gpu.alloc(chunk * k)?,
            tiles: gpu.alloc(max_tiles * 2)?,
            tile_count: gpu.alloc(1)?,
            max_tiles,
            act: gpu.alloc(chunk * k * c.moe_intermediate_size)?,
            shared_act: gpu.alloc(chunk * c.shared_expert_intermediate_size)?,
            expert_out: gpu.alloc(chunk * k * h)?,
            shared_out: gpu.alloc(chunk * h)?,
            gdn: GdnScratch::new(gpu, c, chunk)?,
            attn: AttnScratch::new(gpu, c, chunk)?,
        })
    }

    /// The entries sorted by expert, as the grouped expert products take them.
    fn sorted(&self) -> gemm::Sorted {
        gemm::Sorted {
            entries: self.entries.ptr(),
            tiles: self.tiles.ptr(),
            tile_count: self.tile_count.ptr(),
            offsets: self.offsets.ptr(),
            max_tiles: self.max_tiles,
        }
    }
}

/// Runs tokens `state.tokens[start .. start + t]` (t <= chunk) through every layer, leaving the last token's
/// hidden state in `state.hidden` and `start + t` in `state.position`, ready for the head or a decode step.
/// `slot[l]` is layer l's index among the layers of its kind (its KV cache or DeltaNet state).
#[allow(clippy::too_many_arguments)]
pub fn enqueue_chunk(
    l: &mut Launcher,
    c: &Config,
    w: &GpuWeights,
    state: &DeviceState,
    slot: &[usize],
    s: &PrefillScratch,
    start: usize,
    t: usize,
) -> Result<()> {
    assert!(t >= 1 && t <= s.chunk, "a chunk takes 1 ..= {} tokens", s.chunk);
    let rows = Dims::linear(t as u32, ROW_THREADS);
    prefill::embed_rows(l, rows, state.tokens.ptr(), start as i32, w.embed.q4(), s.hidden.ptr())?;
    for (i, layer) in w.layers.iter().enumerate() {
        let (normed, no_lo) = (s.normed.ptr(), DevPtr::NULL);
        prefill::rmsnorm_rows(l, rows, s.hidden.ptr(), layer.input_norm.ptr(), normed, no_lo)?;
        match &layer.mixer {
            GpuMixer::Linear(g) => {
                gemm::gemm(l, s.normed.ptr(), t, &g.in_proj, s.proj.ptr(), false)?;
                let (ring, recurrent) = (&state.conv_ring[slot[i]], &state.recurrent[slot[i]]);
                s.gdn.run(
                    l,
                    c,
                    t,
                    start,
                    s.proj.ptr(),
                    ring.ptr(),
                    recurrent.ptr(),
                    g,
                    s.mixed.ptr(),
                )?;
                gemm::gemm(l, s.mixed.ptr(), t, &g.out_proj, s.hidden.ptr(), true)?;
            }
            GpuMixer::Full(a) => {
                gemm::gemm(l, s.normed.ptr(), t, &a.qkv, s.proj.ptr(), false)?;
                let (k_cache, v_cache) = (state.k_cache[slot[i]].ptr(), state.v_cache[slot[i]].ptr());
                let inv_freq = state.inv_freq.ptr();
                s.attn.run(
                    l,
                    c,
                    t,
                    start,
                    s.proj.ptr(),
                    a,
                    inv_freq,
                    k_cache,
                    v_cache,
                    s.mixed.ptr(),
                )?;
                gemm::gemm(l, s.mixed.ptr(), t, &a.o_proj, s.hidden.ptr(), true)?;
            }
        }
        // The sparse MoE: route, sort the (token, slot) entries by expert, grouped expert products, shared expert.
        let (normed, normed_lo) = (s.normed.ptr(), s.normed_lo.ptr());
        prefill::rmsnorm_rows(l, rows, s.hidden.ptr(), layer.post_norm.ptr(), normed, normed_lo)?;
        // Routing follows small differences between logits: the router sees the normed input to about 16 bits.
        gemm::gemm(l, normed, t, &layer.router, s.router_logits.ptr(), false)?;
        gemm::gemm(l, normed_lo, t, &layer.router, s.router_logits.ptr(), true)?;
        route_and_sort(l, c, s, t)?;
        let sorted = s.sorted();
        gemm::moe_gate_up(l, normed, &sorted, &layer.experts_gate, &layer.experts_up, s.act.ptr())?;
        let route_w = s.route_w.ptr();
        gemm::moe_down(
            l,
            s.act.ptr(),
            &sorted,
            route_w,
            &layer.experts_down,
            s.expert_out.ptr(),
        )?;
        gemm::gemm_swiglu(l, normed, t, &layer.shared_gate, &layer.shared_up, s.shared_act.ptr())?;
        gemm::gemm(l, s.shared_act.ptr(), t, &layer.shared_down, s.shared_out.ptr(), false)?;
        let (expert_out, shared_out, shared_w) = (s.expert_out.ptr(), s.shared_out.ptr(), s.shared_w.ptr());
        prefill::moe_combine(l, rows, s.hidden.ptr(), expert_out, shared_out, shared_w)?;
    }
    let h = c.hidden_size;
    l.gpu.copy(state.hidden.ptr(), s.hidden.at((t - 1) * h), h)?;
    l.gpu.upload_async(state.position.ptr(), &[(start + t) as i32])
}

/// The routing of `t` tokens from `s.router_logits` (ids, weights, the shared expert's gate) and the stable sort of
/// their (token, slot) entries by expert, with the tiles of the grouped products.
pub(crate) fn route_and_sort(l: &mut Launcher, c: &Config, s: &PrefillScratch, t: usize) -> Result<()> {
    l.gpu.memset_u32(s.counts.ptr(), 0, c.num_experts)?;
    let warps_per_block = ROW_THREADS as usize / 32;
    prefill::route_rows(
        l,
        Dims::linear(t.div_ceil(warps_per_block) as u32, ROW_THREADS),
        s.router_logits.ptr(),
        t as i32,
        s.route_ids.ptr(),
        s.route_w.ptr(),
        s.shared_w.ptr(),
        s.counts.ptr(),
    )?;
    let tile_rows = l.kernels.constant("moe_tile_rows") as i32;
    prefill::moe_sort(
        l,
        Dims::linear(c.num_experts as u32, 256),
        s.route_ids.ptr(),
        t as i32,
        s.counts.ptr(),
        tile_rows,
        s.offsets.ptr(),
        s.entries.ptr(),
        s.tiles.ptr(),
        s.tile_count.ptr(),
    )
}

/// `lily selftest`'s checks of the glue kernels against their CPU twins: embedding rows, RMSNorm rows (bf16 out:
/// tolerance 4e-3, half a bf16 step), routing (exact ids; weights 1e-5) with the stable sort by expert and its
/// tiles (exact), and the combine (1e-5: f32 sums in another order).
pub(crate) fn check(
    gpu: &Gpu,
    kernels: &Kernels,
    w: &lily_model::weights::Weights,
    gw: &GpuWeights,
    seed: u64,
    report: &mut crate::selftest::Report,
) -> Result<()> {
    use crate::selftest::{download_f32, normals, poison, rel_err};
    use half::bf16;
    use lily_model::cpu::linalg::{rmsnorm, sigmoid};
    use lily_model::cpu::moe::route;
    use lily_model::rng::Rng;

    let c = &w.config;
    let (h, e, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
    let mut rng = Rng::new(seed ^ 0x9ef111);
    let t = 301;
    let mut l = Launcher::new(gpu, kernels);
    let l = &mut l;
    let s = PrefillScratch::new(gpu, kernels, c, t)?;
    let rows = Dims::linear(t as u32, ROW_THREADS);

    // Embedding rows.
    let tokens: Vec<i32> = (0..t + 3)
        .map(|_| (rng.next_u64() % c.vocab_size as u64) as i32)
        .collect();
    let tokens_buf = gpu.upload_new(&tokens)?;
    poison(gpu, &s.hidden)?;
    prefill::embed_rows(l, rows, tokens_buf.ptr(), 3, gw.embed.q4(), s.hidden.ptr())?;
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
    let norm = gw.layers[0].input_norm.ptr();
    prefill::rmsnorm_rows(l, rows, s.hidden.ptr(), norm, s.normed.ptr(), s.normed_lo.ptr())?;
    let (mut hi, mut lo) = (vec![bf16::ZERO; t * h], vec![bf16::ZERO; t * h]);
    gpu.download(s.normed.ptr(), &mut hi)?;
    gpu.download(s.normed_lo.ptr(), &mut lo)?;
    let got: Vec<f32> = hi.iter().map(|v| v.to_f32()).collect();
    let both: Vec<f32> = hi.iter().zip(&lo).map(|(a, b)| a.to_f32() + b.to_f32()).collect();
    let mut expected = vec![0.0; t * h];
    for (x, out) in hidden.chunks(h).zip(expected.chunks_mut(h)) {
        rmsnorm(x, &w.layers[0].input_norm, c.rms_norm_eps, out);
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

    // Routing, the stable sort by expert and the tiles.
    let logits = normals(&mut rng, t * (e + 1), 2.0);
    gpu.upload(s.router_logits.ptr(), &logits)?;
    poison(gpu, &s.route_w)?;
    poison(gpu, &s.entries)?;
    let tile_rows = kernels.constant("moe_tile_rows");
    route_and_sort(l, c, &s, t)?;
    let (mut ids, mut weights) = (vec![0usize; t * k], vec![0.0f32; t * k]);
    for r in 0..t {
        route(
            &logits[r * (e + 1)..][..e],
            k,
            &mut ids[r * k..][..k],
            &mut weights[r * k..][..k],
        );
    }
    let mut gpu_ids = vec![0i32; t * k];
    gpu.download(s.route_ids.ptr(), &mut gpu_ids)?;
    report.check_eq(
        "route_rows: top-k experts of every token",
        gpu_ids.iter().zip(&ids).all(|(a, b)| *a as usize == *b),
        "",
    );
    report.check(
        "route_rows: routing weights",
        rel_err(&download_f32(gpu, &s.route_w, t * k)?, &weights),
        1e-5,
    );
    let shared: Vec<f32> = (0..t).map(|r| sigmoid(logits[r * (e + 1) + e])).collect();
    report.check(
        "route_rows: shared expert gate",
        rel_err(&download_f32(gpu, &s.shared_w, t)?, &shared),
        1e-6,
    );
    let mut order: Vec<usize> = (0..t * k).collect();
    order.sort_by_key(|&i| ids[i]);
    let mut offsets = vec![0i32; e + 1];
    let mut tiles = Vec::new();
    for x in 0..e {
        let n = ids.iter().filter(|&&i| i == x).count();
        offsets[x + 1] = offsets[x] + n as i32;
        tiles.extend((0..n.div_ceil(tile_rows)).flat_map(|j| [x as i32, offsets[x] + (j * tile_rows) as i32]));
    }
    let mut gpu_entries = vec![0i32; t * k];
    gpu.download(s.entries.ptr(), &mut gpu_entries)?;
    let mut gpu_offsets = vec![0i32; e + 1];
    gpu.download(s.offsets.ptr(), &mut gpu_offsets)?;
    let mut gpu_count = [0i32];
    gpu.download(s.tile_count.ptr(), &mut gpu_count)?;
    let mut gpu_tiles = vec![0i32; tiles.len()];
    gpu.download(s.tiles.ptr(), &mut gpu_tiles)?;
    let sorted = gpu_entries.iter().zip(&order).all(|(a, b)| *a as usize == *b) && gpu_offsets == offsets;
    report.check_eq("moe_sort: entries stably sorted by expert, offsets", sorted, "");
    report.check_eq(
        "moe_sort: tiles",
        gpu_count[0] as usize * 2 == tiles.len() && gpu_tiles == tiles,
        &format!("{} tiles", tiles.len() / 2),
    );

    // Combine into the residual stream.
    let expert_out = normals(&mut rng, t * k * h, 1.0);
    let shared_out = normals(&mut rng, t * h, 1.0);
    gpu.upload(s.expert_out.ptr(), &expert_out)?;
    gpu.upload(s.shared_out.ptr(), &shared_out)?;
    gpu.upload(s.hidden.ptr(), &hidden)?;
    let (expert_out_p, shared_out_p, shared_w_p) = (s.expert_out.ptr(), s.shared_out.ptr(), s.shared_w.ptr());
    prefill::moe_combine(l, rows, s.hidden.ptr(), expert_out_p, shared_out_p, shared_w_p)?;
    let expected: Vec<f32> = (0..t * h)
        .map(|i| {
            let (r, col) = (i / h, i % h);
            hidden[i] + (0..k).map(|j| expert_out[(r * k + j) * h + col]).sum::<f32>() + shared[r] * shared_out[i]
        })
        .collect();
    report.check(
        "moe_combine (routed + gated shared + residual)",
        rel_err(&download_f32(gpu, &s.hidden, t * h)?, &expected),
        1e-5,
    );
    gpu.sync()
}
