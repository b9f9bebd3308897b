//! The CUDA backend: state preallocated on the GPU, and the decode step (embedding, 40 layers, final norm,
//! lm_head, greedy choice) as device work captured once into two CUDA graphs and replayed: `layers` (through the
//! position's advance) and `head`. Positions and token ids are read from device memory, so the graphs never
//! change; the stream writes in a token id (no copy) and the head kernel writes the chosen one to pinned host
//! memory, which the host reads after synchronising. The state is laid out for many sequences (slots): the
//! single-sequence step is the batch of one row in slot 0, whose page-table row maps position p to page p / 64
//! (the identity), so its KV is contiguous as a plain cache would be. From Hopper on every kernel (the decode
//! step's, the batched step's, the prefill's) is launched with programmatic dependent launch: each starts while its
//! predecessor runs, requests what does not depend on it (weights, its own state), and waits for the predecessor's
//! results (`wait_previous` in common.cuh) before it reads them or writes; only then may the kernel after it start.

use lily_model::backend::Backend;
use lily_model::sampling::{Sampler, SamplingParams};
use lily_model::Config;
use lily_model::ForwardError;

use half::{bf16, f16};

use crate::driver::{check, DevBuf, DevPtr, Gpu, GpuError, Graph, HostCell, Result};
use crate::kernels::sampling::{self, RowParams};
use crate::kernels::{attention, deltanet, layout, matvec, moe, synth, Kernels, ATTN_SPLITS};
use crate::launch::{Dims, Launcher, Profile};
pub use crate::pages::Capacity;
use crate::pages::{pages_for, PageAllocator, PageCopy, KV_PAGE};
use crate::prefill::{enqueue_chunk, ChunkPart, Cut, PrefillScratch, PREFILL_CHUNK, PREFILL_PARTS};
use crate::sample_rows::{self, SampleRows};
use crate::weights::{GpuMixer, GpuWeights, Source};

/// Per-sequence state for `max_seqs` slots and the single-sequence step's activations, all allocated up front.
pub struct DeviceState {
    /// Sequence slots: DeltaNet state for each; KV pages from the shared pools.
    pub max_seqs: usize,
    /// Entries of a slot's page-table row: ceil(max_context / KV_PAGE).
    pub pages_per_seq: usize,
    /// i32: the position of the single-sequence step's token (tokens already in the context of slot 0).
    pub position: DevBuf<i32>,
    /// i32 `[1]` = 0: the slot of the single-sequence step's one row.
    pub single_slot: DevBuf<i32>,
    /// i32 `[max_context]`: the single sequence's token ids.
    pub tokens: DevBuf<i32>,
    /// i32 in host memory: the token the last step chose greedily, read without a copy.
    pub next_token: HostCell,
    pub hidden: DevBuf<f32>,
    /// Input projections of the current mixer.
    pub proj: DevBuf<f32>,
    /// DeltaNet raw output, or the gated attention output.
    pub core: DevBuf<f32>,
    pub q: DevBuf<f32>,
    pub part_o: DevBuf<f32>,
    pub part_ml: DevBuf<f32>,
    /// The router's logits and the shared expert's gate (written for the self-test; the routing does not read them).
    pub router_logits: DevBuf<f32>,
    pub act: DevBuf<f32>,
    pub route_ids: DevBuf<i32>,
    pub route_w: DevBuf<f32>,
    /// Set by experts_gate_up once the routing is written (see moe.cu).
    pub route_ready: DevBuf<u32>,
    pub logits: DevBuf<f32>,
    pub block_best: DevBuf<f32>,
    pub block_arg: DevBuf<i32>,
    pub blocks_done: DevBuf<u32>,
    pub inv_freq: DevBuf<f32>,
    /// Per full-attention layer: the K and V pools, bf16 `[kv_pages][KV_PAGE][kv_heads][head_dim]`. A page id
    /// indexes the same page in every layer's pools.
    pub k_pool: Vec<DevBuf<bf16>>,
    pub v_pool: Vec<DevBuf<bf16>>,
    /// i32 `[max_seqs][pages_per_seq]`: entry j of slot s is the page holding its positions 64 j .. 64 j + 63.
    pub page_table: DevBuf<i32>,
    /// Per DeltaNet layer: `[max_seqs][conv_k][conv_dim]`; ring row `position % conv_k` holds that position's
    /// input.
    pub conv_ring: Vec<DevBuf<f32>>,
    /// Per DeltaNet layer: `[max_seqs][value_heads][key_dim][value_dim]`, f16 (the kernels compute in f32).
    pub recurrent: Vec<DevBuf<f16>>,
    /// Snapshot buffers: the DeltaNet state of a sequence saved at some length, to start others from.
    pub snapshots: usize,
    /// Per DeltaNet layer: `[snapshots][conv_k][conv_dim]` and `[snapshots][value_heads][key_dim][value_dim]`,
    /// laid out as the slots' `conv_ring` and `recurrent`.
    pub snapshot_ring: Vec<DevBuf<f32>>,
    pub snapshot_recurrent: Vec<DevBuf<f16>>,
}

/// Where a sequence's DeltaNet state is: in a slot, or in a snapshot buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateAt {
    Slot(usize),
    Snapshot(usize),
}

impl DeviceState {
    /// Floats of one slot's conv ring in a layer.
    pub fn ring_len(&self, c: &Config) -> usize {
        c.linear_conv_kernel_dim * c.linear_conv_dim()
    }

    /// Values of one slot's recurrent state in a layer.
    pub fn recurrent_len(&self, c: &Config) -> usize {
        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    }

    /// DeltaNet layer `layer` (its index among the DeltaNet layers): slot `seq`'s conv ring.
    pub fn ring(&self, layer: usize, seq: usize) -> DevPtr<f32> {
        let len = self.conv_ring[layer].len() / self.max_seqs;
        self.conv_ring[layer].at(seq * len)
    }

    /// DeltaNet layer `layer`: slot `seq`'s recurrent state.
    pub fn recurrent_state(&self, layer: usize, seq: usize) -> DevPtr<f16> {
        let len = self.recurrent[layer].len() / self.max_seqs;
        self.recurrent[layer].at(seq * len)
    }

    /// DeltaNet layer `layer`: the conv ring and the recurrent state at `at`.
    pub fn deltanet_state(&self, layer: usize, at: StateAt) -> (DevPtr<f32>, DevPtr<f16>) {
        match at {
            StateAt::Slot(seq) => (self.ring(layer, seq), self.recurrent_state(layer, seq)),
            StateAt::Snapshot(n) => {
                assert!(n < self.snapshots, "snapshot buffer {n} of {}", self.snapshots);
                let ring = &self.snapshot_ring[layer];
                let recurrent = &self.snapshot_recurrent[layer];
                (
                    ring.at(n * (ring.len() / self.snapshots)),
                    recurrent.at(n * (recurrent.len() / self.snapshots)),
                )
            }
        }
    }

    /// Slot `seq`'s page-table row.
    pub fn page_row(&self, seq: usize) -> DevPtr<i32> {
        self.page_table.at(seq * self.pages_per_seq)
    }
}

/// Launch geometry fixed by the model and the GPU.
struct Grids {
    proj_deltanet: u32,
    proj_attn: u32,
    out_proj_deltanet: u32,
    out_proj_attn: u32,
    gate_up: u32,
    down: u32,
    lm_head: u32,
}

/// One operation of the decode step; `l` is a layer index.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    Embed,
    /// The DeltaNet's q/k/v/z/b/a or the attention's q/k/v projection, with the input RMSNorm.
    MixerInProj(usize),
    DeltaNetStep(usize),
    DeltaNetOutProj(usize),
    AttnPrep(usize),
    AttnPartial(usize),
    AttnMerge(usize),
    AttnOutProj(usize),
    /// The router, the routing, and the gate and up projections of the chosen and the shared experts.
    ExpertsGateUp(usize),
    ExpertsDown(usize),
    AdvancePosition,
    LmHead,
}

// Fields drop in order: buffers and modules before the context (`gpu`) they belong to.
pub struct CudaModel {
    pub kernels: Kernels,
    pub config: Config,
    pub weights: GpuWeights,
    pub state: DeviceState,
    pub max_context: usize,
    /// The KV pages each slot holds (mirrored in `state.page_table`) and the free ones.
    pub pages: PageAllocator,
    grids: Grids,
    pub(crate) slot: Vec<usize>,
    pub prefill: PrefillScratch,
    /// The sampler's buffers for the one sequence's row (draws other than the fused greedy choice).
    pub sampler: SampleRows,
    /// Tokens a prefill chunk takes (at most `prefill.chunk`; lowered by tests to force several chunks).
    pub prefill_chunk: usize,
    /// u64 `[COPY_SPANS][3]`: the (source, destination, bytes) table of a `copy_spans` launch.
    copy_table: DevBuf<u64>,
    pub gpu: Gpu,
}

/// Spans a `copy_spans` launch takes: a sequence's DeltaNet state (two a DeltaNet layer) and a KV page (two an
/// attention layer) fit in one.
const COPY_SPANS: usize = 128;
/// Blocks of `copy_spans` a span: a recurrent state of 1 MiB is 64 rounds of 256 threads x 16 bytes among them.
const COPY_SPAN_BLOCKS: u32 = 64;

/// A copy on the device: (source address, destination address, bytes), as `copy_spans` reads it.
pub type Span = [u64; 3];

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

impl CudaModel {
    /// One sequence of up to `max_context` tokens: slot 0 holds pages for all of it, in order (the identity page
    /// table), as [`CudaBackend`] needs.
    pub fn single(
        gpu: Gpu,
        config: Config,
        source: &Source,
        max_context: usize,
        progress: &dyn Fn(usize, usize),
    ) -> Result<CudaModel> {
        let capacity = Capacity::single(max_context);
        let mut model = CudaModel::new(gpu, config, source, max_context, capacity, progress)?;
        if !model.reserve(0, max_context)? {
            return Err(GpuError::Other("no KV pages for the single sequence".into()));
        }
        Ok(model)
    }

    /// Compiles the kernels, loads the weights and allocates the state: `capacity.max_seqs` sequence slots of up to
    /// `max_context` tokens each, and `capacity.kv_pages` KV pages shared by them (none reserved yet).
    pub fn new(
        gpu: Gpu,
        config: Config,
        source: &Source,
        max_context: usize,
        capacity: Capacity,
        progress: &dyn Fn(usize, usize),
    ) -> Result<CudaModel> {
        let c = &config;
        if capacity.max_seqs == 0 || max_context == 0 {
            return Err(GpuError::Other(
                "the model needs at least one slot and a context of one token".into(),
            ));
        }
        if capacity.max_seqs > PREFILL_CHUNK {
            return Err(GpuError::Other(format!(
                "{} sequences at once is more than a batched step takes ({PREFILL_CHUNK})",
                capacity.max_seqs
            )));
        }
        if c.shared_expert_intermediate_size != c.moe_intermediate_size
            || c.head_dim != 256
            || c.num_attention_heads / c.num_key_value_heads != 8
        {
            return Err(GpuError::Other(
                "the CUDA kernels need shared expert width = expert width, head_dim 256 and 8 query heads per KV head"
                    .into(),
            ));
        }
        let kernels = Kernels::load(&gpu, c)?;
        let weights = GpuWeights::load(&gpu, &kernels, c, source, progress)?;
        let f32s = |n: usize| gpu.alloc_zeroed::<f32>(n);
        let occupancy = |name: &'static str, threads: i32| -> Result<usize> {
            let mut n = 0i32;
            check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
                cudarc::driver::sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut n,
                    kernels.get(name).0,
                    threads,
                    0,
                )
            })?;
            Ok(n.max(1) as usize * gpu.sm_count)
        };
        // A matrix-vector grid: every tile of rows once, or as many blocks as fit at once, each taking tiles in turn.
        let mv_grid = |name: &'static str, rows: usize, rows_per_block: usize| -> Result<u32> {
            Ok(rows.div_ceil(rows_per_block).min(occupancy(name, 256)?) as u32)
        };
        let rpb_h = kernels.constant("rows_per_block_hidden");
        let grids = Grids {
            proj_deltanet: mv_grid(
                "proj_normed",
                c.linear_conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads,
                rpb_h,
            )?,
            proj_attn: mv_grid("proj_normed", 2 * c.q_dim() + 2 * c.kv_dim(), rpb_h)?,
            out_proj_deltanet: mv_grid(
                "out_proj_deltanet",
                c.hidden_size,
                kernels.constant("rows_per_block_linear_v"),
            )?,
            out_proj_attn: mv_grid("out_proj_attn", c.hidden_size, kernels.constant("rows_per_block_q"))?,
            gate_up: blocks(
                (c.num_experts_per_tok + 1) * c.moe_intermediate_size,
                kernels.constant("pairs_per_block"),
            ),
            down: blocks(c.hidden_size, kernels.constant("down_rows_per_block")),
            lm_head: mv_grid("lm_head", c.vocab_size, rpb_h)?,
        };
        let (max_seqs, pages_per_seq) = (capacity.max_seqs, pages_for(max_context));
        let pool_len = capacity.kv_pages * KV_PAGE * c.kv_dim();
        // Values of one sequence's conv ring and recurrent state in a DeltaNet layer.
        let ring_len = c.linear_conv_kernel_dim * c.linear_conv_dim();
        let recurrent_len = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
        let state = DeviceState {
            max_seqs,
            pages_per_seq,
            position: gpu.alloc_zeroed(1)?,
            single_slot: gpu.alloc_zeroed(1)?,
            tokens: gpu.alloc_zeroed(max_context)?,
            next_token: gpu.host_cell()?,
            hidden: f32s(c.hidden_size)?,
            proj: f32s(
                (c.linear_conv_dim() + c.linear_value_dim() + 2 * c.linear_num_value_heads)
                    .max(2 * c.q_dim() + 2 * c.kv_dim()),
            )?,
            core: f32s(c.linear_value_dim().max(c.q_dim()))?,
            q: f32s(c.q_dim())?,
            part_o: f32s(c.num_attention_heads * ATTN_SPLITS * c.head_dim)?,
            part_ml: f32s(c.num_attention_heads * ATTN_SPLITS * 2)?,
            router_logits: f32s(c.num_experts + 1)?,
            act: f32s((c.num_experts_per_tok + 1) * c.moe_intermediate_size)?,
            route_ids: gpu.alloc_zeroed(c.num_experts_per_tok)?,
            route_ready: gpu.alloc_zeroed(1)?,
            route_w: f32s(c.num_experts_per_tok + 1)?,
            logits: f32s(c.vocab_size)?,
            block_best: f32s(grids.lm_head as usize)?,
            block_arg: gpu.alloc_zeroed(grids.lm_head as usize)?,
            blocks_done: gpu.alloc_zeroed(1)?,
            inv_freq: gpu.upload_new(&c.rope_inv_freq())?,
            k_pool: (0..c.num_full_layers())
                .map(|_| gpu.alloc_zeroed(pool_len))
                .collect::<Result<_>>()?,
            v_pool: (0..c.num_full_layers())
                .map(|_| gpu.alloc_zeroed(pool_len))
                .collect::<Result<_>>()?,
            page_table: gpu.alloc_zeroed(max_seqs * pages_per_seq)?,
            conv_ring: (0..c.num_linear_layers())
                .map(|_| f32s(max_seqs * ring_len))
                .collect::<Result<_>>()?,
            recurrent: (0..c.num_linear_layers())
                .map(|_| gpu.alloc_zeroed::<f16>(max_seqs * recurrent_len))
                .collect::<Result<_>>()?,
            snapshots: capacity.snapshots,
            snapshot_ring: (0..c.num_linear_layers())
                .map(|_| gpu.alloc(capacity.snapshots * ring_len))
                .collect::<Result<_>>()?,
            snapshot_recurrent: (0..c.num_linear_layers())
                .map(|_| gpu.alloc(capacity.snapshots * recurrent_len))
                .collect::<Result<_>>()?,
        };
        let slot = c.layer_slots();
        let chunk = crate::prefill::scratch_rows(max_context, capacity.max_seqs);
        let prefill = PrefillScratch::new(&gpu, &kernels, c, chunk, max_context)?;
        let sampler = SampleRows::new(&gpu, 1, c.vocab_size)?;
        let copy_table = gpu.alloc_zeroed(3 * COPY_SPANS)?;
        gpu.sync()?;
        Ok(CudaModel {
            gpu,
            kernels,
            config,
            weights,
            state,
            max_context,
            pages: PageAllocator::new(max_seqs, capacity.kv_pages, pages_per_seq, capacity.snapshots),
            grids,
            slot,
            prefill,
            sampler,
            prefill_chunk: chunk,
            copy_table,
        })
    }

    /// A launcher of this model's kernels.
    pub fn launcher<'a>(&'a self, profile: Option<&'a mut Profile>) -> Launcher<'a> {
        Launcher {
            profile,
            ..Launcher::new(&self.gpu, &self.kernels)
        }
    }

    /// The decode step through the layers, in order, for the token `tokens[position]`, ending with the position's
    /// advance; then the head (final norm, lm_head, greedy choice).
    pub fn layer_ops(&self) -> Vec<Op> {
        let mut ops = vec![Op::Embed];
        for (l, layer) in self.weights.layers.iter().enumerate() {
            match layer.mixer {
                GpuMixer::Linear(_) => ops.extend([Op::MixerInProj(l), Op::DeltaNetStep(l), Op::DeltaNetOutProj(l)]),
                GpuMixer::Full(_) => ops.extend([
                    Op::MixerInProj(l),
                    Op::AttnPrep(l),
                    Op::AttnPartial(l),
                    Op::AttnMerge(l),
                    Op::AttnOutProj(l),
                ]),
            }
            ops.extend([Op::ExpertsGateUp(l), Op::ExpertsDown(l)]);
        }
        ops.push(Op::AdvancePosition);
        ops
    }

    pub fn enqueue_layers(&self, mut profile: Option<&mut Profile>) -> Result<()> {
        for op in self.layer_ops() {
            self.enqueue(op, &mut profile)?;
        }
        Ok(())
    }

    pub fn enqueue_head(&self, mut profile: Option<&mut Profile>) -> Result<()> {
        self.enqueue(Op::LmHead, &mut profile)
    }

    /// Queues one operation of the step (its inputs and outputs are the state's buffers).
    pub fn enqueue(&self, op: Op, p: &mut Option<&mut Profile>) -> Result<()> {
        let c = &self.config;
        let s = &self.state;
        let w = &self.weights;
        let deltanet = |l: usize| match &w.layers[l].mixer {
            GpuMixer::Linear(g) => Ok(g),
            GpuMixer::Full(_) => Err(GpuError::Other(format!("layer {l} is not a DeltaNet layer"))),
        };
        let attn = |l: usize| match &w.layers[l].mixer {
            GpuMixer::Full(a) => Ok(a),
            GpuMixer::Linear(_) => Err(GpuError::Other(format!("layer {l} is not an attention layer"))),
        };
        let l = &mut self.launcher(p.as_deref_mut());
        let mv = |grid: u32| Dims::linear(grid, 256);
        match op {
            Op::Embed => matvec::embed(
                l,
                mv(blocks(c.hidden_size, 256)),
                s.position.ptr(),
                s.tokens.ptr(),
                w.embed_tokens.q4(),
                s.hidden.ptr(),
            ),
            Op::MixerInProj(i) => {
                let layer = &w.layers[i];
                let (m, grid) = match &layer.mixer {
                    GpuMixer::Linear(g) => (&g.in_proj, self.grids.proj_deltanet),
                    GpuMixer::Full(a) => (&a.qkv, self.grids.proj_attn),
                };
                let (hidden, norm, proj) = (s.hidden.ptr(), layer.input_layernorm.ptr(), s.proj.ptr());
                matvec::proj_normed(l, mv(grid), hidden, norm, m.q4(), proj, m.rows as i32)
            }
            Op::DeltaNetStep(i) => {
                let g = deltanet(i)?;
                let slot = self.slot[i];
                let dn_split = l.kernels.constant("deltanet_split") as u32;
                deltanet::deltanet_step(
                    l,
                    Dims::new((c.linear_num_value_heads as u32, dn_split, 1), 256),
                    s.position.ptr(),
                    s.single_slot.ptr(),
                    s.proj.ptr(),
                    s.conv_ring[slot].ptr(),
                    g.conv1d.ptr(),
                    g.a_log.ptr(),
                    g.dt_bias.ptr(),
                    s.recurrent[slot].ptr(),
                    s.core.ptr(),
                )
            }
            Op::DeltaNetOutProj(i) => {
                let g = deltanet(i)?;
                let z = s.proj.at(c.linear_conv_dim());
                let grid = mv(self.grids.out_proj_deltanet);
                matvec::out_proj_deltanet(l, grid, s.core.ptr(), z, g.norm.ptr(), g.out_proj.q4(), s.hidden.ptr())
            }
            Op::AttnPrep(i) => {
                let a = attn(i)?;
                let slot = self.slot[i];
                attention::attn_prep(
                    l,
                    Dims::linear(
                        (c.num_attention_heads + c.num_key_value_heads) as u32,
                        c.head_dim as u32,
                    ),
                    s.position.ptr(),
                    s.single_slot.ptr(),
                    s.proj.ptr(),
                    a.q_norm.ptr(),
                    a.k_norm.ptr(),
                    s.inv_freq.ptr(),
                    s.q.ptr(),
                    s.k_pool[slot].ptr(),
                    s.v_pool[slot].ptr(),
                    s.page_table.ptr(),
                    s.pages_per_seq as i32,
                )
            }
            Op::AttnPartial(i) => {
                let slot = self.slot[i];
                attention::attn_partial(
                    l,
                    Dims::new((c.num_key_value_heads as u32, ATTN_SPLITS as u32, 1), 256),
                    s.position.ptr(),
                    s.single_slot.ptr(),
                    s.q.ptr(),
                    s.k_pool[slot].ptr(),
                    s.v_pool[slot].ptr(),
                    s.page_table.ptr(),
                    s.pages_per_seq as i32,
                    ATTN_SPLITS as i32,
                    s.part_o.ptr(),
                    s.part_ml.ptr(),
                )
            }
            Op::AttnMerge(_) => attention::attn_merge(
                l,
                Dims::new((c.num_attention_heads as u32, (c.head_dim / 32) as u32, 1), 256),
                s.position.ptr(),
                ATTN_SPLITS as i32,
                s.part_o.ptr(),
                s.part_ml.ptr(),
                s.proj.ptr(),
                s.core.ptr(),
                DevPtr::NULL,
            ),
            Op::AttnOutProj(i) => {
                let a = attn(i)?;
                let grid = mv(self.grids.out_proj_attn);
                matvec::out_proj_attn(l, grid, s.core.ptr(), a.o_proj.q4(), s.hidden.ptr())
            }
            Op::ExpertsGateUp(i) => {
                let layer = &w.layers[i];
                moe::experts_gate_up(
                    l,
                    Dims::linear(self.grids.gate_up, self.kernels.constant("gate_up_threads") as u32),
                    s.hidden.ptr(),
                    layer.post_attention_layernorm.ptr(),
                    layer.router.q4(),
                    layer.experts_gate.tiled_q4(),
                    layer.experts_up.tiled_q4(),
                    layer.shared_gate.tiled_q4(),
                    layer.shared_up.tiled_q4(),
                    s.router_logits.ptr(),
                    s.act.ptr(),
                    s.route_ids.ptr(),
                    s.route_w.ptr(),
                    s.route_ready.ptr(),
                )
            }
            Op::ExpertsDown(i) => {
                let layer = &w.layers[i];
                moe::experts_down(
                    l,
                    Dims::linear(self.grids.down, ((c.num_experts_per_tok + 1) * 32) as u32),
                    s.act.ptr(),
                    s.route_ids.ptr(),
                    s.route_w.ptr(),
                    s.route_ready.ptr(),
                    layer.experts_down.tiled_q4(),
                    layer.shared_down.tiled_q4(),
                    s.hidden.ptr(),
                )
            }
            Op::AdvancePosition => matvec::advance_position(l, Dims::linear(1, 1), s.position.ptr()),
            Op::LmHead => sampling::lm_head(
                l,
                mv(self.grids.lm_head),
                s.hidden.ptr(),
                w.final_norm.ptr(),
                w.lm_head.q4(),
                s.logits.ptr(),
                s.block_best.ptr(),
                s.block_arg.ptr(),
                s.blocks_done.ptr(),
                s.next_token.ptr,
            ),
        }
    }

    /// Queues the sampler over the logits of the last step: `row`'s draw among the tokens `allowed` lets through
    /// (all when `None`), ready for [`CudaModel::sampled_token`] after a synchronisation.
    pub fn enqueue_sample(&mut self, row: RowParams, allowed: Option<&[u32]>) -> Result<()> {
        let launcher = &mut Launcher::new(&self.gpu, &self.kernels);
        let logits = self.state.logits.ptr();
        self.sampler.enqueue(launcher, logits, &[row], &[allowed])
    }

    /// The token the last `enqueue_sample` drew (waits for the GPU).
    pub fn sampled_token(&self) -> Result<u32> {
        self.gpu.sync()?;
        Ok(self.sampler.read()[0])
    }

    /// Prefills the single sequence's `tokens[start .. start + count]` (already in `state.tokens`) in slot 0,
    /// chunk by chunk; leaves the last token's hidden state for the head and the position at `start + count`.
    pub fn enqueue_prefill(&self, start: usize, count: usize, profile: Option<&mut Profile>) -> Result<()> {
        self.enqueue_prefill_from(0, start, count, self.state.tokens.at(start), &[], profile)?;
        self.gpu
            .upload_async(self.state.position.ptr(), &[(start + count) as i32])
    }

    /// Prefills positions `start .. start + count` of the sequence in slot `slot`, chunk by chunk, with the
    /// `count` token ids at `tokens` (device i32); leaves the last token's hidden state in `state.hidden`. The
    /// slot's pages must hold `start + count` positions ([`CudaModel::reserve`]).
    /// At each of `cuts` (ascending, inside 0 .. count), the DeltaNet state as it stands after that many of the
    /// `count` tokens is also copied to the cut's buffer, inside the pass.
    pub fn enqueue_prefill_slot(
        &self,
        slot: usize,
        start: usize,
        count: usize,
        tokens: DevPtr<i32>,
        cuts: &[Cut],
    ) -> Result<()> {
        self.enqueue_prefill_from(slot, start, count, tokens, cuts, None)
    }

    /// Prefills several sequences in one pass (see [`enqueue_chunk`]): each part's tokens are at `tokens` (device
    /// i32, the parts' one after another, at most one chunk in all), and each part's last hidden state is left in
    /// row i of `prefill.last`. Every part's slot must hold its positions ([`CudaModel::reserve`]).
    pub fn enqueue_prefill_parts(&self, parts: &[ChunkPart<'_>], tokens: DevPtr<i32>) -> Result<()> {
        let t: usize = parts.iter().map(|p| p.t).sum();
        if parts.is_empty() || parts.len() > PREFILL_PARTS || t > self.prefill_chunk {
            return Err(GpuError::Other(format!(
                "a prefill pass of {} parts and {t} tokens: 1 ..= {PREFILL_PARTS} parts, {} tokens",
                parts.len(),
                self.prefill_chunk
            )));
        }
        if let Some(p) = parts
            .iter()
            .find(|p| p.seq >= self.state.max_seqs || p.start + p.t > self.pages.capacity(p.seq))
        {
            return Err(GpuError::Other(format!(
                "prefill of positions {} .. {} in slot {}, which does not hold them",
                p.start,
                p.start + p.t,
                p.seq
            )));
        }
        let c = &self.config;
        let mut launcher = self.launcher(None);
        let (w, state, prefill) = (&self.weights, &self.state, &self.prefill);
        enqueue_chunk(
            &mut launcher,
            c,
            w,
            state,
            &self.slot,
            prefill,
            tokens,
            parts,
            prefill.last.ptr(),
        )
    }

    fn enqueue_prefill_from(
        &self,
        slot: usize,
        start: usize,
        count: usize,
        tokens: DevPtr<i32>,
        cuts: &[Cut],
        profile: Option<&mut Profile>,
    ) -> Result<()> {
        if slot >= self.state.max_seqs || start + count > self.pages.capacity(slot) {
            return Err(GpuError::Other(format!(
                "prefill of positions {start} .. {} in slot {slot}: the slot holds {} (of {} slots)",
                start + count,
                self.pages.capacity(slot.min(self.state.max_seqs - 1)),
                self.state.max_seqs
            )));
        }
        let mut launcher = self.launcher(profile);
        let mut done = 0;
        while done < count {
            let t = (count - done).min(self.prefill_chunk);
            // Cuts inside this chunk are taken in its pass; one at its end is a copy of the state after it.
            let inside: Vec<Cut> = cuts
                .iter()
                .filter(|cut| cut.tokens > done && cut.tokens < done + t)
                .map(|cut| Cut {
                    tokens: cut.tokens - done,
                    to: cut.to,
                })
                .collect();
            let part = ChunkPart {
                seq: slot,
                start: start + done,
                t,
                cuts: &inside,
            };
            enqueue_chunk(
                &mut launcher,
                &self.config,
                &self.weights,
                &self.state,
                &self.slot,
                &self.prefill,
                tokens.offset(done),
                &[part],
                self.state.hidden.ptr(),
            )?;
            done += t;
            if let Some(cut) = cuts.iter().find(|cut| cut.tokens == done) {
                self.copy_deltanet_state(StateAt::Slot(slot), cut.to)?;
            }
        }
        Ok(())
    }

    /// Gives slot `slot` KV pages for positions 0 .. `tokens` and uploads its changed page-table entries. Returns
    /// false, changing nothing, when the free pages are too few or `tokens` is past max_context.
    pub fn reserve(&mut self, slot: usize, tokens: usize) -> Result<bool> {
        if slot >= self.state.max_seqs {
            return Err(GpuError::Other(format!("slot {slot} of {}", self.state.max_seqs)));
        }
        let held = self.pages.pages(slot).len();
        if !self.pages.reserve(slot, tokens) {
            return Ok(false);
        }
        let new = &self.pages.pages(slot)[held..];
        self.gpu.upload_async(self.state.page_row(slot).offset(held), new)?;
        Ok(true)
    }

    /// Slot `slot` lets go of its KV pages, which return to the free list unless a snapshot or another slot holds
    /// them (its page-table row is left as it was and not read again until the next reservation overwrites it).
    pub fn release(&mut self, slot: usize) {
        if slot < self.state.max_seqs {
            self.pages.release(slot);
        }
    }

    /// Queues the upload of slot `slot`'s whole page-table row as the allocator holds it.
    pub fn upload_page_row(&self, slot: usize) -> Result<()> {
        self.gpu.upload_async(self.state.page_row(slot), self.pages.pages(slot))
    }

    /// Queues the copies of `spans`, `COPY_SPANS` a launch, each launch's table uploaded through the stream first.
    pub fn copy_spans(&self, spans: &[Span]) -> Result<()> {
        for part in spans.chunks(COPY_SPANS) {
            let table: Vec<u64> = part.iter().flatten().copied().collect();
            self.gpu.upload_async(self.copy_table.ptr(), &table)?;
            let dims = Dims::new((COPY_SPAN_BLOCKS, part.len() as u32, 1), 256);
            layout::copy_spans(&mut self.launcher(None), dims, self.copy_table.ptr(), part.len() as i32)?;
        }
        Ok(())
    }

    /// The spans that copy KV page `copy.from` into page `copy.to` in every attention layer's K and V pools.
    pub fn page_spans(&self, copy: PageCopy) -> Vec<Span> {
        let page = KV_PAGE * self.config.kv_dim();
        let (from, to) = (copy.from as usize * page, copy.to as usize * page);
        let bytes = (page * size_of::<bf16>()) as u64;
        self.state
            .k_pool
            .iter()
            .chain(&self.state.v_pool)
            .map(|pool| [pool.at(from).raw(), pool.at(to).raw(), bytes])
            .collect()
    }

    /// The spans that copy the DeltaNet conv and recurrent state of every layer from `from` to `to`.
    pub fn deltanet_state_spans(&self, from: StateAt, to: StateAt) -> Vec<Span> {
        let s = &self.state;
        let ring_bytes = (s.ring_len(&self.config) * size_of::<f32>()) as u64;
        let recurrent_bytes = (s.recurrent_len(&self.config) * size_of::<f16>()) as u64;
        (0..s.conv_ring.len())
            .flat_map(|layer| {
                let ((ring_from, recurrent_from), (ring_to, recurrent_to)) =
                    (s.deltanet_state(layer, from), s.deltanet_state(layer, to));
                [
                    [ring_from.raw(), ring_to.raw(), ring_bytes],
                    [recurrent_from.raw(), recurrent_to.raw(), recurrent_bytes],
                ]
            })
            .collect()
    }

    /// Queues a copy of the DeltaNet conv and recurrent state of every layer from `from` to `to`.
    pub fn copy_deltanet_state(&self, from: StateAt, to: StateAt) -> Result<()> {
        self.copy_spans(&self.deltanet_state_spans(from, to))
    }

    /// KV pages no slot holds.
    pub fn free_pages(&self) -> usize {
        self.pages.free_pages()
    }

    /// KV pages of the pool, held or free.
    pub fn total_pages(&self) -> usize {
        self.pages.total_pages()
    }

    /// Zeroes slot `slot`'s DeltaNet conv and recurrent state (a new sequence starts there).
    pub fn reset_slot(&self, slot: usize) -> Result<()> {
        let c = &self.config;
        for l in 0..self.state.conv_ring.len() {
            let s = &self.state;
            let (ring_bytes, recurrent_bytes) =
                (s.ring_len(c) * size_of::<f32>(), s.recurrent_len(c) * size_of::<f16>());
            self.gpu.memset_u8(s.ring(l, slot), 0, ring_bytes)?;
            self.gpu.memset_u8(s.recurrent_state(l, slot), 0, recurrent_bytes)?;
        }
        Ok(())
    }

    /// Runs one step un-captured with events around every launch; sums GPU time per kernel.
    pub fn profile_step(&self) -> Result<Profile> {
        let mut profile = Profile::default();
        self.enqueue_layers(Some(&mut profile))?;
        self.enqueue_head(Some(&mut profile))?;
        profile.collect()?;
        Ok(profile)
    }

    /// Forgets the single sequence: position 0, slot 0's DeltaNet conv and recurrent state zeroed (its KV pages are
    /// overwritten as positions fill).
    pub fn reset(&self) -> Result<()> {
        self.gpu.memset_u8(self.state.position.ptr(), 0, 4)?;
        self.reset_slot(0)
    }

    /// Sets the single sequence's context to `depth` tokens of random state (benchmarks): random keys and values
    /// in the first pages of the pools (slot 0's, in the identity table), random conv inputs and recurrent state,
    /// position `depth`.
    pub fn fill_random_state(&self, depth: usize, seed: u64) -> Result<()> {
        if depth > self.pages.capacity(0) {
            return Err(GpuError::Other(format!(
                "a context of {depth} tokens: slot 0 holds {}",
                self.pages.capacity(0)
            )));
        }
        let c = &self.config;
        let dims = |n: usize| Dims::linear(n.div_ceil(256).min(65536) as u32, 256);
        let l = &mut self.launcher(None);
        let mut stream = 0u64;
        let mut next_stream = || {
            stream += 1;
            stream
        };
        for (k, v) in self.state.k_pool.iter().zip(&self.state.v_pool) {
            for buf in [k, v] {
                let (n, stream) = (depth * c.kv_dim(), next_stream());
                if n > 0 {
                    synth::fill_uniform_bf16(l, dims(n), buf.ptr(), n as u64, seed, stream, -1.0, 1.0)?;
                }
            }
        }
        for (ring, rec) in self.state.conv_ring.iter().zip(&self.state.recurrent) {
            let (n, stream) = (ring.len(), next_stream());
            synth::fill_uniform_f32(l, dims(n), ring.ptr(), n as u64, seed, stream, -1.0, 1.0)?;
            let (n, stream) = (rec.len(), next_stream());
            synth::fill_uniform_f16(l, dims(n), rec.ptr(), n as u64, seed, stream, -0.05, 0.05)?;
        }
        self.gpu.upload(self.state.position.ptr(), &[depth as i32])
    }
}

/// [`Backend`] over a [`CudaModel`]: the step captured as graphs on first use.
pub struct CudaBackend {
    graphs: Option<(Graph, Graph)>,
    /// Host copy of the device position.
    position: usize,
    logits: Vec<f32>,
    logits_current: bool,
    /// Last, so the graphs are destroyed before the context.
    pub model: CudaModel,
}

impl CudaBackend {
    pub fn new(model: CudaModel) -> CudaBackend {
        let vocab = model.config.vocab_size;
        CudaBackend {
            model,
            graphs: None,
            position: 0,
            logits: vec![0.0; vocab],
            logits_current: false,
        }
    }

    fn graphs(&mut self) -> Result<&(Graph, Graph)> {
        if self.graphs.is_none() {
            let layers = self.model.gpu.capture(|| self.model.enqueue_layers(None))?;
            let head = self.model.gpu.capture(|| self.model.enqueue_head(None))?;
            self.graphs = Some((layers, head));
        }
        Ok(self.graphs.as_ref().expect("just captured"))
    }

    /// Replays the layers for each of `count` tokens already in `tokens[position..]`, then the head.
    pub fn run_steps(&mut self, count: usize) -> Result<()> {
        self.graphs()?;
        let (layers, head) = self.graphs.as_ref().expect("captured");
        for _ in 0..count {
            self.model.gpu.replay(layers)?;
        }
        self.model.gpu.replay(head)?;
        self.position += count;
        self.logits_current = false;
        Ok(())
    }

    /// The chosen next token after the last step (waits for the GPU).
    pub fn read_next_token(&self) -> Result<u32> {
        self.model.gpu.sync()?;
        Ok(self.model.state.next_token.read() as u32)
    }

    /// Places the context at `depth` random tokens of state (benchmarks).
    pub fn set_random_context(&mut self, depth: usize, seed: u64) -> Result<()> {
        self.model.fill_random_state(depth, seed)?;
        self.position = depth;
        Ok(())
    }

    /// Starts an empty sequence (zeroed state, position 0).
    pub fn clear(&mut self) -> Result<()> {
        self.model.reset()?;
        self.position = 0;
        self.model.gpu.sync()
    }

    fn check(&self, tokens: &[u32]) -> std::result::Result<(), ForwardError> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.model.config.vocab_size) {
            return Err(ForwardError::BadToken(bad));
        }
        let needed = self.position + tokens.len();
        let max_context = self.model.max_context.min(self.model.pages.capacity(0));
        if needed > max_context {
            return Err(ForwardError::ContextFull { needed, max_context });
        }
        Ok(())
    }

    /// Runs `count` tokens already in `tokens[position..]` through the prefill, then the head.
    fn run_prefill(&mut self, count: usize) -> Result<()> {
        self.graphs()?;
        self.model.enqueue_prefill(self.position, count, None)?;
        let (_, head) = self.graphs.as_ref().expect("captured");
        self.model.gpu.replay(head)?;
        self.position += count;
        self.logits_current = false;
        Ok(())
    }

    /// Continues the sequence with `tokens` (a prefill after the context so far).
    pub fn extend(&mut self, tokens: &[u32]) -> std::result::Result<(), ForwardError> {
        self.model.gpu.bind().map_err(device_err)?;
        if tokens.is_empty() {
            return Err(ForwardError::EmptyPrompt);
        }
        self.check(tokens)?;
        self.append(tokens).map_err(device_err)
    }

    /// One token goes through the captured decode step (its id written by the stream: no copy); more through the
    /// prefill.
    fn append(&mut self, tokens: &[u32]) -> Result<()> {
        // Ids below the vocabulary size (checked) have the same bytes as the kernels' i32.
        let at = self.model.state.tokens.at(self.position).cast::<u32>();
        match tokens {
            &[token] => {
                self.model.gpu.write_u32(at, token)?;
                self.run_steps(1)
            }
            _ => {
                self.model.gpu.upload_async(at, tokens)?;
                self.run_prefill(tokens.len())
            }
        }
    }
}

fn device_err(e: GpuError) -> ForwardError {
    ForwardError::Device(e.to_string())
}

impl Backend for CudaBackend {
    fn config(&self) -> &Config {
        &self.model.config
    }
    fn max_context(&self) -> usize {
        self.model.max_context
    }
    fn prefill(&mut self, prompt: &[u32]) -> std::result::Result<(), ForwardError> {
        self.model.gpu.bind().map_err(device_err)?;
        if prompt.is_empty() {
            return Err(ForwardError::EmptyPrompt);
        }
        self.position = 0;
        self.check(prompt)?;
        self.model.reset().map_err(device_err)?;
        self.append(prompt).map_err(device_err)
    }
    /// The prompt goes to the GPU one prefill chunk at a time; after each chunk the host waits for the GPU and asks
    /// `cancelled`, so a client that went away stops a long prompt within one chunk's time.
    fn prefill_cancellable(
        &mut self,
        prompt: &[u32],
        cancelled: &dyn Fn() -> bool,
    ) -> std::result::Result<bool, ForwardError> {
        let mut slices = prompt.chunks(self.model.prefill_chunk.max(1));
        let Some(first) = slices.next() else {
            return Err(ForwardError::EmptyPrompt);
        };
        self.prefill(first)?;
        for slice in slices {
            self.synchronize()?;
            if cancelled() {
                return Ok(false);
            }
            self.extend(slice)?;
        }
        Ok(true)
    }
    fn decode(&mut self, token: u32) -> std::result::Result<(), ForwardError> {
        self.model.gpu.bind().map_err(device_err)?;
        self.check(&[token])?;
        self.append(&[token]).map_err(device_err)
    }
    fn extend(&mut self, tokens: &[u32]) -> std::result::Result<(), ForwardError> {
        CudaBackend::extend(self, tokens)
    }
    fn logits(&mut self) -> std::result::Result<&[f32], ForwardError> {
        if !self.logits_current {
            let logits = self.model.state.logits.ptr();
            self.model.gpu.download(logits, &mut self.logits).map_err(device_err)?;
            self.logits_current = true;
        }
        Ok(&self.logits)
    }
    /// Greedy is the lm_head's fused choice; other draws `sample_rows` makes on the GPU when it can.
    fn sample(&mut self, sampler: &mut Sampler) -> std::result::Result<u32, ForwardError> {
        let p = sampler.params();
        if !sample_rows::on_device(p) {
            return Ok(sampler.sample(self.logits()?));
        }
        if p.is_greedy() {
            return self.read_next_token().map_err(device_err);
        }
        let counter = sampler.next_draw();
        let row = RowParams::new(sampler.params(), counter);
        self.model.gpu.bind().map_err(device_err)?;
        self.model.enqueue_sample(row, None).map_err(device_err)?;
        match self.model.sampled_token().map_err(device_err)? {
            // Left to the host (what a top-p or min-p keeps runs past the GPU's head): the draw is made here.
            u32::MAX => {
                sampler.return_draw();
                Ok(sampler.sample(self.logits()?))
            }
            token => Ok(token),
        }
    }
    /// The mask goes to the GPU (vocab / 8 bytes) and `sample_rows` draws there, instead of the logits coming out.
    fn sample_masked(&mut self, sampler: &mut Sampler, allowed: &[u32]) -> std::result::Result<u32, ForwardError> {
        let p = sampler.params();
        if !sample_rows::on_device(p) {
            let mut logits = self.logits()?.to_vec();
            return Ok(sampler.sample_masked(&mut logits, allowed));
        }
        let counter = if p.is_greedy() { 0 } else { sampler.next_draw() };
        let row = RowParams::new(sampler.params(), counter);
        self.model.gpu.bind().map_err(device_err)?;
        self.model.enqueue_sample(row, Some(allowed)).map_err(device_err)?;
        match self.model.sampled_token().map_err(device_err)? {
            u32::MAX => {
                sampler.return_draw();
                let mut logits = self.logits()?.to_vec();
                Ok(sampler.sample_masked(&mut logits, allowed))
            }
            token => Ok(token),
        }
    }
    /// `sample_rows` draws as `Sampler` does for greedy, for top-k in 1..=HEAD (the host sampler's) and without a
    /// top-k (the whole softmax, or a top-p or min-p that ends within the GPU's head of candidates, else the draw
    /// falls back to the host); a top-k past HEAD needs the logits copied out.
    fn samples_on_device(&self, params: &SamplingParams) -> bool {
        sample_rows::on_device(params)
    }
    fn synchronize(&mut self) -> std::result::Result<(), ForwardError> {
        self.model.gpu.sync().map_err(device_err)
    }
    fn describe(&self) -> String {
        format!("cuda: {}", self.model.gpu.name)
    }
}
