//! Continuous batching on the GPU: the batched decode step and the [`BatchBackend`] over it.
//!
//! Up to `max_step_rows` sequences, each in its own slot of the model's state (see [`crate::model::DeviceState`]:
//! DeltaNet state per slot, attention KV in pages of one pool), advance one token together. The step is the
//! prefill's token-parallel pass with one row a sequence: the products and the MoE take the rows as a prefill
//! chunk takes its tokens (each chosen expert's weights read once for all the rows routed to it), while each
//! mixer reads and writes its own row's sequence at its own position. The step for a given number of rows is
//! captured as a CUDA graph the first time it runs and replayed after, so a step costs one launch.
//!
//! Snapshots (the prefix cache's saved sequences) keep a sequence's DeltaNet state in a buffer of their own and
//! share its KV pages by reference (see [`crate::pages::PageAllocator`]); a sequence restored from one shares its
//! full pages and copies only the partial last page, the one it goes on writing.

use std::collections::HashMap;

use half::bf16;
use rayon::prelude::*;

use lily_model::backend::{check_cuts, check_parts, BatchBackend, Pick, PrefillPart, Slot, SnapshotId, StepRow};
use lily_model::{Config, ForwardError};

use crate::driver::{DevBuf, DevPtr, Gpu, GpuError, Graph, Result};
use crate::gemm;
use crate::kernels::sampling::RowParams;
use crate::kernels::{attention, deltanet, prefill, Q8x2, ATTN_SPLITS};
use crate::launch::{Dims, Launcher};
use crate::model::{Capacity, CudaModel, DeviceState, StateAt};
use crate::pages::KV_PAGE;
use crate::prefill::{enqueue_input_norm, enqueue_moe, ChunkPart, Cut, PrefillScratch, PREFILL_PARTS, ROW_THREADS};
use crate::sample_rows::{self, SampleRows};
use crate::weights::{GpuMixer, GpuWeights};

/// The step's own buffers. The rest (residual stream, normed rows, projections, the MoE's sort and products) is
/// the prefill chunk's scratch, which the step shares: a step and a prefill never run at once.
pub struct StepScratch {
    pub max_rows: usize,
    /// i32 `[3][max_rows]`: each row's token id, position and slot, uploaded together before a step.
    pub rows: DevBuf<i32>,
    /// f32 `[max_rows][q dim]`: the attention's normed, rotated queries.
    pub q: DevBuf<f32>,
    /// f32: the attention's parts per row (`[max_rows][heads][ATTN_SPLITS][head_dim]`) and their max and sum.
    pub part_o: DevBuf<f32>,
    pub part_ml: DevBuf<f32>,
    /// f32 `[max_rows][vocab]`: each row's next-token logits.
    pub logits: DevBuf<f32>,
}

impl StepScratch {
    pub fn new(gpu: &Gpu, c: &Config, max_rows: usize) -> Result<StepScratch> {
        let parts = max_rows * c.num_attention_heads * ATTN_SPLITS;
        Ok(StepScratch {
            max_rows,
            rows: gpu.alloc_zeroed(3 * max_rows)?,
            q: gpu.alloc(max_rows * c.q_dim())?,
            part_o: gpu.alloc(parts * c.head_dim)?,
            part_ml: gpu.alloc(parts * 2)?,
            logits: gpu.alloc(max_rows * c.vocab_size)?,
        })
    }

    fn tokens(&self) -> DevPtr<i32> {
        self.rows.ptr()
    }

    fn positions(&self) -> DevPtr<i32> {
        self.rows.at(self.max_rows)
    }

    fn slots(&self) -> DevPtr<i32> {
        self.rows.at(2 * self.max_rows)
    }

    /// Device bytes for `max_rows` rows (to size the KV pool from what is left).
    pub fn bytes(c: &Config, max_rows: usize) -> usize {
        let parts = max_rows * c.num_attention_heads * ATTN_SPLITS;
        4 * (3 * max_rows + max_rows * (c.linear_value_dim() + c.q_dim() + c.vocab_size) + parts * (c.head_dim + 2))
    }
}

/// Parts the attention splits each row's context into in a step of `rows` rows: enough blocks for about `per_sm`
/// an SM (the kernels' `attn_rows_blocks_per_sm`) over all rows and KV heads, at most ATTN_SPLITS (one row alone
/// takes them all, as the single-sequence step).
pub fn attention_splits(rows: usize, kv_heads: usize, sm_count: usize, per_sm: usize) -> usize {
    (per_sm * sm_count).div_ceil(rows * kv_heads).clamp(1, ATTN_SPLITS)
}

/// What the attention's parts of a batched step read and write (see `attn_partial` in kernels/attention.cu).
#[derive(Clone, Copy)]
pub(crate) struct AttentionParts {
    pub positions: DevPtr<i32>,
    pub slots: DevPtr<i32>,
    pub q: DevPtr<f32>,
    pub k_pool: DevPtr<bf16>,
    pub v_pool: DevPtr<bf16>,
    pub page_table: DevPtr<i32>,
    pub pages_per_seq: i32,
    pub part_o: DevPtr<f32>,
    pub part_ml: DevPtr<f32>,
}

/// Queues the attention's parts of `rows` rows, each row's context in `splits` parts: on the tensor cores
/// (`attn_partial_rows`) where a block may have the shared memory that kernel takes, else on CUDA cores.
pub(crate) fn attention_parts(
    l: &mut Launcher,
    p: &AttentionParts,
    rows: usize,
    kv_heads: usize,
    splits: i32,
) -> Result<()> {
    let grid = (kv_heads as u32, splits as u32, rows as u32);
    let smem = l.kernels.constant("attn_rows_smem");
    let AttentionParts {
        positions,
        slots,
        q,
        k_pool: k,
        v_pool: v,
        page_table: table,
        pages_per_seq: per_seq,
        part_o,
        part_ml,
    } = *p;
    if smem <= l.gpu.max_shared_per_block {
        let dims = Dims::new(grid, 128).shared(smem as u32);
        attention::attn_partial_rows(
            l, dims, positions, slots, q, k, v, table, per_seq, splits, part_o, part_ml,
        )
    } else {
        let dims = Dims::new(grid, 256);
        attention::attn_partial(
            l, dims, positions, slots, q, k, v, table, per_seq, splits, part_o, part_ml,
        )
    }
}

/// Merges the parts `attention_parts` left for `rows` rows and gates them into `attn_bf16` (bf16 `[rows][q dim]`;
/// the gate is in `proj`): a warp per row's head slice where the rows have few parts (`attn_merge_rows`, which also
/// codes the rows into `codes` unless that is [`Q8x2::NONE`]), else eight warps sharing a slice's parts
/// (`attn_merge`, which codes none). Returns whether the rows were coded.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_merge(
    l: &mut Launcher,
    c: &Config,
    rows: usize,
    splits: i32,
    p: &AttentionParts,
    proj: DevPtr<f32>,
    attn_bf16: DevPtr<bf16>,
    codes: Q8x2,
) -> Result<bool> {
    let (heads, head_dim) = (c.num_attention_heads, c.head_dim);
    if splits as usize <= l.kernels.constant("attn_merge_rows_max_splits") {
        let warps = rows * heads * head_dim / 32;
        let dims = Dims::linear(warps.div_ceil(8) as u32, 256);
        let (part_o, part_ml) = (p.part_o, p.part_ml);
        attention::attn_merge_rows(
            l,
            dims,
            p.positions,
            rows as i32,
            splits,
            part_o,
            part_ml,
            proj,
            attn_bf16,
            codes,
        )?;
        return Ok(codes.codes.raw() != 0);
    }
    attention::attn_merge(
        l,
        Dims::new((heads as u32, (head_dim / 32) as u32, rows as u32), 256),
        p.positions,
        splits,
        p.part_o,
        p.part_ml,
        proj,
        DevPtr::NULL,
        attn_bf16,
    )?;
    Ok(false)
}

/// One decode step of `t` rows whose token ids, positions and slots are in `b.rows`: every layer over the rows,
/// then the final norm and lm_head into `b.logits`. `slot[l]` is layer l's index among the layers of its kind.
#[allow(clippy::too_many_arguments)]
pub fn enqueue_step(
    l: &mut Launcher,
    c: &Config,
    w: &GpuWeights,
    state: &DeviceState,
    slot: &[usize],
    s: &PrefillScratch,
    b: &StepScratch,
    t: usize,
) -> Result<()> {
    assert!(t >= 1 && t <= b.max_rows, "a step takes 1 ..= {} rows", b.max_rows);
    let rows = Dims::linear(t as u32, ROW_THREADS);
    let (positions, slots, t32) = (b.positions(), b.slots(), t as u32);
    let (heads, kv_heads, head_dim) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let per_sm = l.kernels.constant("attn_rows_blocks_per_sm");
    let splits = attention_splits(t, kv_heads, l.gpu.sm_count, per_sm) as i32;
    prefill::embed_rows(l, rows, b.tokens(), 0, w.embed_tokens.q4(), s.hidden.ptr())?;
    // The MoE rows of the layer before, which this layer's norm adds to the residual stream first.
    let mut experts = DevPtr::NULL;
    for (i, layer) in w.layers.iter().enumerate() {
        let (normed, codes) = (s.normed.ptr(), enqueue_input_norm(l, layer, s, t, experts)?);
        // The MoE's norm adds the output projection's parts of k, where the product leaves them.
        let out_parts = match &layer.mixer {
            GpuMixer::Linear(g) => {
                gemm::gemm_coded(l, normed, t, &g.in_proj, s.proj.ptr(), false, codes.is_some())?;
                // The step ends with the gated norm, which also codes its rows for out_proj where that takes the
                // integer small tiling.
                let out_codes = gemm::small_codes(l, t, &g.out_proj);
                deltanet::deltanet_step_rows(
                    l,
                    Dims::new((c.linear_num_value_heads as u32, 1, t32), 256),
                    positions,
                    slots,
                    s.proj.ptr(),
                    state.conv_ring[slot[i]].ptr(),
                    g.conv1d.ptr(),
                    g.a_log.ptr(),
                    g.dt_bias.ptr(),
                    state.recurrent[slot[i]].ptr(),
                    DevPtr::NULL,
                    g.norm.ptr(),
                    s.mixed.ptr(),
                    out_codes.unwrap_or(Q8x2::NONE),
                )?;
                let coded = out_codes.is_some();
                gemm::gemm_coded_leaving_parts(l, s.mixed.ptr(), t, &g.out_proj, s.hidden.ptr(), coded)?
            }
            GpuMixer::Full(a) => {
                gemm::gemm_coded(l, normed, t, &a.qkv, s.proj.ptr(), false, codes.is_some())?;
                let (k_pool, v_pool) = (state.k_pool[slot[i]].ptr(), state.v_pool[slot[i]].ptr());
                let (table, per_seq) = (state.page_table.ptr(), state.pages_per_seq as i32);
                attention::attn_prep(
                    l,
                    Dims::new(((heads + kv_heads) as u32, 1, t32), head_dim as u32),
                    positions,
                    slots,
                    s.proj.ptr(),
                    a.q_norm.ptr(),
                    a.k_norm.ptr(),
                    state.inv_freq.ptr(),
                    b.q.ptr(),
                    k_pool,
                    v_pool,
                    table,
                    per_seq,
                )?;
                let parts = AttentionParts {
                    positions,
                    slots,
                    q: b.q.ptr(),
                    k_pool,
                    v_pool,
                    page_table: table,
                    pages_per_seq: per_seq,
                    part_o: b.part_o.ptr(),
                    part_ml: b.part_ml.ptr(),
                };
                attention_parts(l, &parts, t, kv_heads, splits)?;
                // The merge also codes its rows for o_proj where that takes the integer small tiling.
                let out_codes = gemm::small_codes(l, t, &a.o_proj).unwrap_or(Q8x2::NONE);
                let coded = attention_merge(l, c, t, splits, &parts, s.proj.ptr(), s.mixed.ptr(), out_codes)?;
                gemm::gemm_coded_leaving_parts(l, s.mixed.ptr(), t, &a.o_proj, s.hidden.ptr(), coded)?
            }
        };
        enqueue_moe(l, c, layer, s, t, out_parts)?;
        experts = s.expert_out.ptr();
    }
    enqueue_head(l, w, s.hidden.ptr(), experts, s, b, t)
}

/// The final norm and lm_head of `t` hidden rows at `hidden` (the last MoE rows `experts` added first, unless
/// null) into `b.logits`.
fn enqueue_head(
    l: &mut Launcher,
    w: &GpuWeights,
    hidden: DevPtr<f32>,
    experts: DevPtr<bf16>,
    s: &PrefillScratch,
    b: &StepScratch,
    t: usize,
) -> Result<()> {
    let rows = Dims::linear(t as u32, ROW_THREADS);
    prefill::rmsnorm_rows(
        l,
        rows,
        hidden,
        experts,
        DevPtr::NULL,
        0,
        w.final_norm.ptr(),
        s.normed.ptr(),
        DevPtr::NULL,
        Q8x2::NONE,
    )?;
    gemm::gemm(l, s.normed.ptr(), t, &w.lm_head, b.logits.ptr(), false)
}

/// Prompt tokens an engine iteration prefills by default on the GPU (see `BatchBackend::prefill_budget`).
pub const PREFILL_BUDGET: usize = 16384;

/// Device bytes of the prefill chunk's scratch per token, rounded up (the full shape needs ~230 kB).
const PREFILL_SCRATCH_PER_TOKEN: usize = 300 << 10;
/// Device memory kept free beside the model's buffers: the context, the compiled kernels, captured graphs.
const RESERVE_BYTES: usize = 1 << 30;

/// Share of the GPU memory free once the weights are loaded that snapshot buffers take when the caller names no
/// budget for them.
pub const SNAPSHOT_SHARE: f64 = 0.1;

/// Snapshot buffers (one sequence's DeltaNet state each) that `budget` bytes hold; where `budget` is `None`,
/// [`SNAPSHOT_SHARE`] of the memory free on `gpu` once the weights (`weight_bytes`) are loaded. A snapshot's
/// attention context is not counted here: it stays in the KV pages it shares with the sequence it was taken from,
/// which come from the pool.
pub fn fit_snapshots(gpu: &Gpu, c: &Config, weight_bytes: usize, budget: Option<usize>) -> Result<usize> {
    let bytes = match budget {
        Some(bytes) => bytes,
        None => (gpu.free_memory()?.saturating_sub(weight_bytes) as f64 * SNAPSHOT_SHARE) as usize,
    };
    Ok(bytes / Capacity::deltanet_bytes_per_seq(c).max(1))
}

/// Slots, KV pages and snapshot buffers for serving up to `max_seqs` sequences of up to `max_context` tokens on
/// `gpu`, where the weights will take `weight_bytes`: the snapshots get `snapshot_bytes` (see [`fit_snapshots`]:
/// `None` gives them [`SNAPSHOT_SHARE`] of the memory free after the weights), and the KV pool gets `fraction` of
/// the memory left once the weights, every slot's and snapshot's DeltaNet state, the scratch buffers and a reserve
/// are counted, and no more than all slots and snapshots at full context could use. Fails when not even one page
/// fits.
pub fn fit_capacity(
    gpu: &Gpu,
    c: &Config,
    weight_bytes: usize,
    max_seqs: usize,
    max_context: usize,
    fraction: f64,
    snapshot_bytes: Option<usize>,
) -> Result<Capacity> {
    let free = gpu.free_memory()?;
    let snapshots = fit_snapshots(gpu, c, weight_bytes, snapshot_bytes)?;
    let chunk = crate::prefill::scratch_rows(max_context, max_seqs);
    let state_per_seq = Capacity::deltanet_bytes_per_seq(c);
    let fixed = weight_bytes
        + (max_seqs + snapshots) * state_per_seq
        + chunk * PREFILL_SCRATCH_PER_TOKEN
        + StepScratch::bytes(c, max_seqs)
        + crate::prefill_attention::score_codes_context_bytes(
            c,
            gpu.compute_capability,
            chunk,
            max_context,
            crate::prefill_attention::values8_requested(),
        )
        + RESERVE_BYTES;
    let page_bytes = Capacity::kv_bytes_per_page(c);
    let left = free.saturating_sub(fixed) as f64 * fraction.clamp(0.0, 1.0);
    let most = (max_seqs + snapshots) * crate::pages::pages_for(max_context);
    let kv_pages = ((left / page_bytes as f64) as usize).min(most);
    if kv_pages == 0 {
        return Err(GpuError::Other(format!(
            "{:.1} GB free on the GPU: the weights ({:.1} GB), {max_seqs} slots and {snapshots} snapshots of state \
             ({:.1} GB) and the scratch leave no room for the KV cache; lower --max-seqs or --context",
            free as f64 / 1e9,
            weight_bytes as f64 / 1e9,
            ((max_seqs + snapshots) * state_per_seq) as f64 / 1e9
        )));
    }
    Ok(Capacity {
        max_seqs,
        kv_pages,
        snapshots,
    })
}

/// Steps of fewer rows than this run each row through the single-sequence decode graph (matrix-vector products,
/// ~1.6 ms a token at the full shape) instead of the batched step, which costs ~3.3 ms at one row and ~3.6 at two
/// but only ~3.8 at three (see bench/RESULTS.md).
pub const SEQUENTIAL_BELOW: usize = 3;

/// A snapshot the backend holds: its DeltaNet state in snapshot buffer `buffer`, its context in the KV pages the
/// page allocator lists for that buffer.
#[derive(Clone, Copy, Debug)]
struct Snapshot {
    buffer: usize,
    len: usize,
}

/// [`BatchBackend`] over a [`CudaModel`] with many slots.
pub struct CudaBatchBackend {
    /// Steps of fewer rows run row by row through the single-sequence graphs (see [`SEQUENTIAL_BELOW`]).
    pub sequential_below: usize,
    /// The single-sequence decode step's graphs (layers, head), captured on first use.
    single: Option<(Graph, Graph)>,
    /// The last call was one row through the single-sequence graphs, whose head also chose the greedy token (read
    /// from pinned memory after a sync, without the sampler's launch).
    single_greedy: bool,
    /// Tokens in each slot's sequence.
    lens: Vec<usize>,
    /// The captured step for each row count that has run.
    graphs: HashMap<usize, Graph>,
    /// Rows of the last prefill (1) or step.
    last_rows: usize,
    /// A host copy of one row's logits: (row, values), current until the next prefill or step.
    host_row: Option<usize>,
    host_logits: Vec<f32>,
    /// `[rows][vocab]`: the rows of the last `sample` that the host draws.
    host_rows: Vec<f32>,
    /// The step's rows as uploaded: token ids, positions, slots, each `max_rows` long.
    staged_rows: Vec<i32>,
    /// The snapshots held, by id: each one's buffer and length.
    snapshots: HashMap<SnapshotId, Snapshot>,
    /// Snapshot buffers no snapshot holds.
    free_snapshot_buffers: Vec<usize>,
    /// The id the next snapshot gets (ids are never reused, so a dropped one stays unknown).
    next_snapshot: SnapshotId,
    /// i32 `[max_prefill_tokens]`: a prefill chunk's token ids.
    prefill_tokens: DevBuf<i32>,
    sampler: SampleRows,
    step: StepScratch,
    /// Last, so the graphs and buffers go before the context.
    pub model: CudaModel,
}

fn device_err(e: GpuError) -> ForwardError {
    ForwardError::Device(e.to_string())
}

impl CudaBatchBackend {
    /// A backend over `model`, whose slots and KV pages it manages from now on; a step takes up to one row a slot.
    pub fn new(model: CudaModel) -> Result<CudaBatchBackend> {
        let max_rows = model.state.max_seqs;
        let c = &model.config;
        let step = StepScratch::new(&model.gpu, c, max_rows)?;
        let sampler = SampleRows::new(&model.gpu, max_rows, c.vocab_size)?;
        let prefill_tokens = model.gpu.alloc_zeroed(model.prefill_chunk)?;
        model.gpu.sync()?;
        Ok(CudaBatchBackend {
            sequential_below: SEQUENTIAL_BELOW,
            single: None,
            single_greedy: false,
            lens: vec![0; max_rows],
            graphs: HashMap::new(),
            last_rows: 0,
            host_row: None,
            host_logits: vec![0.0; c.vocab_size],
            host_rows: Vec::new(),
            staged_rows: vec![0; 3 * max_rows],
            snapshots: HashMap::new(),
            free_snapshot_buffers: (0..model.state.snapshots).rev().collect(),
            next_snapshot: 0,
            prefill_tokens,
            sampler,
            step,
            model,
        })
    }

    /// The step's buffers (for benchmarks and checks that queue a step themselves).
    pub fn step_scratch(&self) -> &StepScratch {
        &self.step
    }

    fn check_slot(&self, slot: Slot) -> std::result::Result<(), ForwardError> {
        if slot >= self.lens.len() {
            return Err(ForwardError::Device(format!("slot {slot} of {}", self.lens.len())));
        }
        Ok(())
    }

    /// The drawn tokens, or a device error if one lies outside the vocabulary: the kernels choose within it for any
    /// logits (a NaN ranks as negative infinity), so such an id means the device's results cannot be trusted, and
    /// it must not reach the tokenizer or the next step.
    fn drawn_in_vocabulary(&self, tokens: Vec<u32>) -> std::result::Result<Vec<u32>, ForwardError> {
        let vocab = self.model.config.vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(ForwardError::Device(format!(
                "the sampler drew token {bad}, outside the vocabulary"
            ))),
            None => Ok(tokens),
        }
    }

    fn check_tokens(&self, tokens: impl IntoIterator<Item = u32>) -> std::result::Result<(), ForwardError> {
        let vocab = self.model.config.vocab_size;
        match tokens.into_iter().find(|&t| t as usize >= vocab) {
            Some(bad) => Err(ForwardError::BadToken(bad)),
            None => Ok(()),
        }
    }

    /// Whether slot `slot` has room for `needed` positions (its reservation, within the context).
    fn check_room(&self, slot: Slot, needed: usize) -> std::result::Result<(), ForwardError> {
        let max_context = self.model.max_context.min(self.model.pages.capacity(slot));
        if needed > max_context {
            return Err(ForwardError::ContextFull { needed, max_context });
        }
        Ok(())
    }

    /// Runs `rows` one at a time through the single-sequence decode graphs: each row's position, slot and token go
    /// to the single step's device scalars (written by the stream), and its logits are copied to its row of
    /// `step.logits`.
    fn run_rows_singly(&mut self, rows: &[StepRow]) -> Result<()> {
        if self.single.is_none() {
            let m = &self.model;
            let layers = m.gpu.capture(|| m.enqueue_layers(None))?;
            let head = m.gpu.capture(|| m.enqueue_head(None))?;
            self.single = Some((layers, head));
        }
        let (layers, head) = self.single.as_ref().expect("captured");
        let m = &self.model;
        let s = &m.state;
        let vocab = m.config.vocab_size;
        for (i, r) in rows.iter().enumerate() {
            let position = self.lens[r.slot];
            m.gpu.write_u32(s.position.ptr().cast(), position as u32)?;
            m.gpu.write_u32(s.single_slot.ptr().cast(), r.slot as u32)?;
            m.gpu.write_u32(s.tokens.at(position).cast(), r.token)?;
            m.gpu.replay(layers)?;
            m.gpu.replay(head)?;
            m.gpu.copy(self.step.logits.at(i * vocab), s.logits.ptr(), vocab)?;
        }
        self.single_greedy = rows.len() == 1;
        Ok(())
    }

    /// `BatchBackend::prefill`, with the DeltaNet state at each cut copied out inside the pass.
    fn prefill_cut(&mut self, slot: Slot, tokens: &[u32], cuts: &[Cut]) -> std::result::Result<(), ForwardError> {
        self.check_slot(slot)?;
        if tokens.is_empty() {
            return Err(ForwardError::EmptyPrompt);
        }
        if tokens.len() > self.model.prefill_chunk {
            return Err(ForwardError::Device(format!(
                "a prefill call takes at most {} tokens, not {}",
                self.model.prefill_chunk,
                tokens.len()
            )));
        }
        self.check_tokens(tokens.iter().copied())?;
        let start = self.lens[slot];
        self.check_room(slot, start + tokens.len())?;
        self.model.gpu.bind().map_err(device_err)?;
        let run = || -> Result<()> {
            let m = &self.model;
            if start == 0 {
                m.reset_slot(slot)?;
            }
            // Ids below the vocabulary size (checked) have the same bytes as the kernels' i32.
            m.gpu.upload_async(self.prefill_tokens.ptr().cast::<u32>(), tokens)?;
            m.enqueue_prefill_slot(slot, start, tokens.len(), self.prefill_tokens.ptr(), cuts)?;
            let l = &mut m.launcher(None);
            enqueue_head(
                l,
                &m.weights,
                m.state.hidden.ptr(),
                DevPtr::NULL,
                &m.prefill,
                &self.step,
                1,
            )?;
            // The upload above reads `tokens` before returning, but the stream must be done with the staging buffer
            // before the next call writes it again.
            m.gpu.sync()
        };
        run().map_err(device_err)?;
        self.lens[slot] = start + tokens.len();
        self.last_rows = 1;
        self.single_greedy = false;
        self.host_row = None;
        Ok(())
    }

    /// Free snapshot buffers for up to `count` cuts (fewer where fewer are free), taken off the free list by
    /// [`CudaBatchBackend::keep_snapshots`] once the pass that fills them has run.
    fn snapshot_buffers(&self, count: usize) -> Vec<usize> {
        let taken = count.min(self.free_snapshot_buffers.len());
        self.free_snapshot_buffers[self.free_snapshot_buffers.len() - taken..].to_vec()
    }

    /// Records the snapshots a pass took of `slot` (which held `start` tokens before it) at `cuts` into `buffers`
    /// (one a cut, fewer where the buffers ran out): each takes a reference on the KV pages of the positions
    /// before its cut. Returns a snapshot id a cut, `None` past the buffers.
    fn keep_snapshots(
        &mut self,
        slot: Slot,
        start: usize,
        cuts: &[usize],
        buffers: &[usize],
    ) -> Vec<Option<SnapshotId>> {
        let mut ids = vec![None; cuts.len()];
        for (id, (&cut, &buffer)) in ids.iter_mut().zip(cuts.iter().zip(buffers)) {
            self.free_snapshot_buffers.retain(|&b| b != buffer);
            self.model.pages.snapshot(slot, start + cut, buffer);
            *id = Some(self.next_snapshot);
            self.snapshots.insert(
                self.next_snapshot,
                Snapshot {
                    buffer,
                    len: start + cut,
                },
            );
            self.next_snapshot += 1;
        }
        ids
    }

    /// `BatchBackend::prefill_parts` of two or more parts: one pass over all their tokens, each part's DeltaNet
    /// state copied out at its cuts inside it, the head over each part's last row.
    fn prefill_together(
        &mut self,
        parts: &[PrefillPart<'_>],
    ) -> std::result::Result<Vec<Vec<Option<SnapshotId>>>, ForwardError> {
        check_parts(parts, self.max_prefill_parts(), self.model.prefill_chunk)?;
        for p in parts {
            self.check_slot(p.slot)?;
            self.check_tokens(p.tokens.iter().copied())?;
            self.check_room(p.slot, self.lens[p.slot] + p.tokens.len())?;
        }
        // The free buffers go to the cuts in order: the earlier parts' cuts first.
        let buffers = self.snapshot_buffers(parts.iter().map(|p| p.cuts.len()).sum());
        let mut free = buffers.iter();
        let cuts: Vec<Vec<Cut>> = parts
            .iter()
            .map(|p| {
                (p.cuts.iter().zip(free.by_ref()))
                    .map(|(&tokens, &buffer)| Cut {
                        tokens,
                        to: StateAt::Snapshot(buffer),
                    })
                    .collect()
            })
            .collect();
        let starts: Vec<usize> = parts.iter().map(|p| self.lens[p.slot]).collect();
        let passes: Vec<ChunkPart<'_>> = parts
            .iter()
            .zip(&cuts)
            .zip(&starts)
            .map(|((p, cuts), &start)| ChunkPart {
                seq: p.slot,
                start,
                t: p.tokens.len(),
                cuts,
            })
            .collect();
        let tokens: Vec<u32> = parts.iter().flat_map(|p| p.tokens.iter().copied()).collect();
        self.model.gpu.bind().map_err(device_err)?;
        let run = || -> Result<()> {
            let m = &self.model;
            for p in passes.iter().filter(|p| p.start == 0) {
                m.reset_slot(p.seq)?;
            }
            // Ids below the vocabulary size (checked) have the same bytes as the kernels' i32.
            m.gpu.upload_async(self.prefill_tokens.ptr().cast::<u32>(), &tokens)?;
            m.enqueue_prefill_parts(&passes, self.prefill_tokens.ptr())?;
            let l = &mut m.launcher(None);
            let last = m.prefill.last.ptr();
            enqueue_head(l, &m.weights, last, DevPtr::NULL, &m.prefill, &self.step, parts.len())?;
            // The stream must be done with the staging buffer before the next call writes it again.
            m.gpu.sync()
        };
        run().map_err(device_err)?;
        for p in parts {
            self.lens[p.slot] += p.tokens.len();
        }
        self.last_rows = parts.len();
        self.single_greedy = false;
        self.host_row = None;
        let mut ids = Vec::with_capacity(parts.len());
        for ((p, cuts), &start) in parts.iter().zip(&cuts).zip(&starts) {
            let buffers: Vec<usize> = cuts
                .iter()
                .map(|cut| match cut.to {
                    StateAt::Snapshot(buffer) => buffer,
                    StateAt::Slot(_) => unreachable!("cuts go to snapshot buffers"),
                })
                .collect();
            ids.push(self.keep_snapshots(p.slot, start, p.cuts, &buffers));
        }
        Ok(ids)
    }

    fn run_step(&mut self, t: usize) -> Result<()> {
        if !self.graphs.contains_key(&t) {
            let m = &self.model;
            let graph = m.gpu.capture(|| {
                let l = &mut m.launcher(None);
                enqueue_step(l, &m.config, &m.weights, &m.state, &m.slot, &m.prefill, &self.step, t)
            })?;
            self.graphs.insert(t, graph);
        }
        self.model.gpu.replay(&self.graphs[&t])
    }
}

impl BatchBackend for CudaBatchBackend {
    fn config(&self) -> &Config {
        &self.model.config
    }
    /// The context a sequence may have: the engine's, or the whole KV pool where that is smaller (`--kv-tokens`
    /// below the context), so that the server's default `max_tokens` asks for no more than can ever be granted.
    fn max_context(&self) -> usize {
        self.model.max_context.min(self.model.total_pages() * KV_PAGE)
    }
    fn max_seqs(&self) -> usize {
        self.lens.len()
    }
    fn max_step_rows(&self) -> usize {
        self.step.max_rows
    }
    fn max_prefill_tokens(&self) -> usize {
        self.model.prefill_chunk
    }
    fn free_tokens(&self) -> usize {
        self.model.free_pages() * KV_PAGE
    }
    fn reserve(&mut self, slot: Slot, tokens: usize) -> std::result::Result<bool, ForwardError> {
        self.check_slot(slot)?;
        if tokens > self.model.max_context {
            return Ok(false);
        }
        self.model.gpu.bind().map_err(device_err)?;
        self.model.reserve(slot, tokens).map_err(device_err)
    }
    fn release(&mut self, slot: Slot) {
        if slot < self.lens.len() {
            self.model.release(slot);
            self.lens[slot] = 0;
        }
    }
    fn len(&self, slot: Slot) -> usize {
        self.lens.get(slot).copied().unwrap_or(0)
    }
    fn prefill(&mut self, slot: Slot, tokens: &[u32]) -> std::result::Result<(), ForwardError> {
        self.prefill_cut(slot, tokens, &[])
    }
    /// 16384, where a pass of 1,000-token prompts served at 256 at once gave the most output tokens (2048, 4096
    /// and 8192 gave less; see bench/RESULTS.md), capped by the prefill chunk: one such pass takes ~0.45 s on an
    /// H200, which bounds how long the running sequences wait for their next token while prompts enter.
    fn prefill_budget(&self) -> usize {
        PREFILL_BUDGET.min(self.model.prefill_chunk)
    }
    fn max_prefill_parts(&self) -> usize {
        PREFILL_PARTS.min(self.step.max_rows).min(self.lens.len())
    }
    fn prefill_parts(
        &mut self,
        parts: &[PrefillPart<'_>],
    ) -> std::result::Result<Vec<Vec<Option<SnapshotId>>>, ForwardError> {
        match parts {
            [part] => Ok(vec![self.prefill_snapshot(part.slot, part.tokens, part.cuts)?]),
            _ => self.prefill_together(parts),
        }
    }
    fn snapshots_in_prefill(&self) -> bool {
        true
    }
    fn snapshot_room(&self) -> usize {
        self.free_snapshot_buffers.len()
    }
    /// One pass: each DeltaNet mixer copies its state at each cut into a free snapshot buffer, and each snapshot
    /// takes a reference on the KV pages of the positions before its cut. Cuts past the free buffers get none.
    fn prefill_snapshot(
        &mut self,
        slot: Slot,
        tokens: &[u32],
        cuts: &[usize],
    ) -> std::result::Result<Vec<Option<SnapshotId>>, ForwardError> {
        check_cuts(tokens.len(), cuts)?;
        let buffers = self.snapshot_buffers(cuts.len());
        let passes: Vec<Cut> = cuts
            .iter()
            .zip(&buffers)
            .map(|(&tokens, &buffer)| Cut {
                tokens,
                to: StateAt::Snapshot(buffer),
            })
            .collect();
        let start = self.len(slot);
        self.prefill_cut(slot, tokens, &passes)?;
        Ok(self.keep_snapshots(slot, start, cuts, &buffers))
    }
    fn fork(&mut self, from: Slot, to: Slot) -> std::result::Result<(), ForwardError> {
        self.check_slot(from)?;
        self.check_slot(to)?;
        let len = self.lens[from];
        if from == to || self.lens[to] != 0 {
            return Err(ForwardError::Device(format!(
                "fork from slot {from} into slot {to}, which is not empty"
            )));
        }
        self.check_room(to, len)?;
        self.model.gpu.bind().map_err(device_err)?;
        // `to` shares the full pages of `from`'s context; the partial last one, which both go on writing, is copied.
        let partial = self.model.pages.share_prefix(from, to, len);
        let m = &self.model;
        let copy = || -> Result<()> {
            let mut spans = m.deltanet_state_spans(StateAt::Slot(from), StateAt::Slot(to));
            if let Some(page) = partial {
                spans.extend(m.page_spans(page));
            }
            m.copy_spans(&spans)?;
            m.upload_page_row(to)?;
            m.gpu.sync()
        };
        copy().map_err(device_err)?;
        self.lens[to] = len;
        Ok(())
    }
    fn step(&mut self, rows: &[StepRow]) -> std::result::Result<(), ForwardError> {
        let max = self.step.max_rows;
        if rows.is_empty() || rows.len() > max {
            return Err(ForwardError::Device(format!(
                "a step takes 1 ..= {max} rows, not {}",
                rows.len()
            )));
        }
        self.check_tokens(rows.iter().map(|r| r.token))?;
        let mut seen = vec![false; self.lens.len()];
        for r in rows {
            self.check_slot(r.slot)?;
            if std::mem::replace(&mut seen[r.slot], true) {
                return Err(ForwardError::Device(format!(
                    "slot {} appears twice in one step",
                    r.slot
                )));
            }
            self.check_room(r.slot, self.lens[r.slot] + 1)?;
        }
        for (i, r) in rows.iter().enumerate() {
            self.staged_rows[i] = r.token as i32;
            self.staged_rows[max + i] = self.lens[r.slot] as i32;
            self.staged_rows[2 * max + i] = r.slot as i32;
        }
        self.model.gpu.bind().map_err(device_err)?;
        if rows.len() < self.sequential_below {
            self.run_rows_singly(rows).map_err(device_err)?;
        } else {
            self.model
                .gpu
                .upload_async(self.step.rows.ptr(), &self.staged_rows)
                .map_err(device_err)?;
            self.run_step(rows.len()).map_err(device_err)?;
            self.single_greedy = false;
        }
        for r in rows {
            self.lens[r.slot] += 1;
        }
        self.last_rows = rows.len();
        self.host_row = None;
        Ok(())
    }
    /// A step is a graph launched on the stream; snapshots, releases and later calls queue behind it.
    fn queues_steps(&self) -> bool {
        true
    }
    fn logits(&mut self, row: usize) -> std::result::Result<&[f32], ForwardError> {
        if row >= self.last_rows {
            return Err(ForwardError::Device(format!("row {row} of {}", self.last_rows)));
        }
        if self.host_row != Some(row) {
            let vocab = self.model.config.vocab_size;
            let at = self.step.logits.at(row * vocab);
            self.model.gpu.download(at, &mut self.host_logits).map_err(device_err)?;
            self.host_row = Some(row);
        }
        Ok(&self.host_logits)
    }
    /// Picks whose parameters the GPU sampler draws as the host would are drawn there, with their masks, in one
    /// launch; the rest copy their row out and sample on the host.
    fn sample(&mut self, picks: &mut [Pick<'_>]) -> std::result::Result<Vec<u32>, ForwardError> {
        let rows = self.last_rows;
        if let Some(bad) = picks.iter().find(|p| p.row >= rows) {
            return Err(ForwardError::Device(format!("row {} of {rows}", bad.row)));
        }
        if let [pick] = picks {
            if self.single_greedy && pick.allowed.is_none() && pick.sampler.params().is_greedy() {
                self.model.gpu.sync().map_err(device_err)?;
                return self.drawn_in_vocabulary(vec![self.model.state.next_token.read() as u32]);
            }
        }
        let mut params = Vec::with_capacity(picks.len());
        let mut masks: Vec<Option<&[u32]>> = Vec::with_capacity(picks.len());
        let mut on_device = Vec::with_capacity(picks.len());
        for pick in picks.iter_mut() {
            let p = pick.sampler.params().clone();
            let here = sample_rows::on_device(&p);
            on_device.push(here);
            if here {
                let counter = if p.is_greedy() { 0 } else { pick.sampler.next_draw() };
                params.push(RowParams {
                    logits_row: pick.row as i32,
                    ..RowParams::new(&p, counter)
                });
                masks.push(pick.allowed);
            }
        }
        let mut drawn = Vec::new().into_iter();
        if !params.is_empty() {
            let m = &self.model;
            let l = &mut m.launcher(None);
            self.sampler
                .enqueue(l, self.step.logits.ptr(), &params, &masks)
                .map_err(device_err)?;
            m.gpu.sync().map_err(device_err)?;
            drawn = self.sampler.read().into_iter();
        }
        // Each row's token where the GPU drew it. It leaves a row to the host (u32::MAX) where what a top-p or
        // min-p keeps runs past its head; that row's draw goes back to the sampler, which makes it on the host.
        let mut tokens: Vec<Option<u32>> = Vec::with_capacity(picks.len());
        for (pick, &here) in picks.iter_mut().zip(&on_device) {
            let token = match here {
                true => Some(drawn.next().expect("one draw per row on the device")),
                false => None,
            };
            if token == Some(u32::MAX) {
                pick.sampler.return_draw();
            }
            tokens.push(token.filter(|&t| t != u32::MAX));
        }
        // The other rows come out whole and are drawn on the host, in parallel: a row is ~250 K logits, so drawing
        // the rows one after another is the longest part of a step where many rows sample on the host.
        let vocab = self.model.config.vocab_size;
        let mut host_picks: Vec<&mut Pick<'_>> = picks
            .iter_mut()
            .zip(&tokens)
            .filter(|(_, token)| token.is_none())
            .map(|(pick, _)| pick)
            .collect();
        self.host_rows.resize(host_picks.len() * vocab, 0.0);
        for (pick, out) in host_picks.iter().zip(self.host_rows.chunks_mut(vocab)) {
            let at = self.step.logits.at(pick.row * vocab);
            self.model.gpu.download(at, out).map_err(device_err)?;
        }
        let mut on_host = host_picks
            .par_iter_mut()
            .zip(self.host_rows.par_chunks(vocab))
            .map_init(Vec::new, |row_copy, (pick, logits)| {
                pick.sample_on_host(logits, row_copy)
            })
            .collect::<Vec<u32>>()
            .into_iter();
        let tokens = tokens
            .into_iter()
            .map(|token| token.unwrap_or_else(|| on_host.next().expect("one draw per row on the host")))
            .collect();
        self.drawn_in_vocabulary(tokens)
    }
    fn synchronize(&mut self) -> std::result::Result<(), ForwardError> {
        self.model.gpu.sync().map_err(device_err)
    }
    fn describe(&self) -> String {
        format!(
            "cuda: {} ({} slots, {} tokens of KV)",
            self.model.gpu.name,
            self.lens.len(),
            self.model.pages.free_pages() * KV_PAGE
        )
    }
    /// Copies the slot's DeltaNet state into a free snapshot buffer and takes a reference on the KV pages of its
    /// context (the last one may be partial: the slot goes on writing the positions after the snapshot's length
    /// into it, which the snapshot never reads).
    fn snapshot(&mut self, slot: Slot) -> std::result::Result<Option<SnapshotId>, ForwardError> {
        self.check_slot(slot)?;
        let Some(&buffer) = self.free_snapshot_buffers.last() else {
            return Ok(None);
        };
        let len = self.lens[slot];
        self.model.gpu.bind().map_err(device_err)?;
        self.model
            .copy_deltanet_state(StateAt::Slot(slot), StateAt::Snapshot(buffer))
            .map_err(device_err)?;
        self.free_snapshot_buffers.pop();
        self.model.pages.snapshot(slot, len, buffer);
        let id = self.next_snapshot;
        self.next_snapshot += 1;
        self.snapshots.insert(id, Snapshot { buffer, len });
        Ok(Some(id))
    }
    /// The slot shares the snapshot's full KV pages, gets its own copy of the partial last one (so that it never
    /// writes into a page another sequence or snapshot reads) and fresh pages for the rest of `tokens`, and a copy
    /// of the DeltaNet state. A slot of length 0 that holds a reservation gives it back first.
    fn restore(&mut self, id: SnapshotId, slot: Slot, tokens: usize) -> std::result::Result<bool, ForwardError> {
        self.check_slot(slot)?;
        let Some(&Snapshot { buffer, len }) = self.snapshots.get(&id) else {
            return Err(ForwardError::Device(format!("no snapshot {id}")));
        };
        if self.lens[slot] != 0 {
            return Err(ForwardError::Device(format!(
                "restore into slot {slot}, which holds a sequence"
            )));
        }
        let started = std::time::Instant::now();
        self.model.release(slot);
        let released = started.elapsed();
        if tokens.max(len) > self.model.max_context {
            return Ok(false);
        }
        let Some(partial) = self.model.pages.restore(buffer, slot, len, tokens) else {
            return Ok(false);
        };
        let paged = started.elapsed();
        self.model.gpu.bind().map_err(device_err)?;
        let m = &self.model;
        let copy = || -> Result<()> {
            let mut spans = m.deltanet_state_spans(StateAt::Snapshot(buffer), StateAt::Slot(slot));
            if let Some(page) = partial {
                spans.extend(m.page_spans(page));
            }
            m.copy_spans(&spans)?;
            m.upload_page_row(slot)
        };
        if let Err(e) = copy() {
            self.model.release(slot);
            return Err(device_err(e));
        }
        tracing::debug!(
            release_ms = released.as_secs_f64() * 1e3,
            pages_ms = (paged - released).as_secs_f64() * 1e3,
            copy_ms = (started.elapsed() - paged).as_secs_f64() * 1e3,
            free_pages = self.model.free_pages(),
            "restored"
        );
        self.lens[slot] = len;
        Ok(true)
    }
    fn drop_snapshot(&mut self, id: SnapshotId) {
        if let Some(snapshot) = self.snapshots.remove(&id) {
            self.model.pages.drop_snapshot(snapshot.buffer);
            self.free_snapshot_buffers.push(snapshot.buffer);
        }
    }
    /// The snapshot buffers in use, and the KV pages that snapshots hold and no slot shares.
    fn snapshot_bytes(&self) -> usize {
        let c = &self.model.config;
        self.snapshots.len() * Capacity::deltanet_bytes_per_seq(c)
            + self.model.pages.snapshot_only_pages() * Capacity::kv_bytes_per_page(c)
    }
    fn snapshot_tokens(&self) -> usize {
        self.model.pages.snapshot_only_pages() * KV_PAGE
    }
}
