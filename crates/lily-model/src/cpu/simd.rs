//! Integer SIMD dot products of affine-quantized weight rows (4 or 8 bits, groups of [`GROUP`], bf16 scale and
//! bias) with an activation vector quantized per group, on the code path the CPU supports: AVX-512 VNNI (4-bit
//! rows in pairs on 512-bit vectors), AVX2, Arm NEON with the dot-product instructions, or portable scalar code.
//!
//! The activations of a group are quantized to three signed bytes each, `x = step * (hi + mid / 256 + lo / 65536)`:
//! `hi` is `x / step` rounded (`step` = the group's largest magnitude / 127), `mid` and `lo` the rounded remainders
//! in 1/256ths and 1/65536ths of a step. So the integer dot products are exact and the only error is the last
//! remainder's rounding, at most `step / 131072` (1/16.6 million of the group's largest magnitude, the precision of
//! an f32): the results match the f32 product of the dequantized weights to f32 rounding, as transformers computes
//! it. (One byte alone, with an error up to `step / 2`, moves logits far past that.) Per group and row, the three
//! integer dot products are accumulated in i32, `256 * mid + lo` combined there, and the weights' scale and bias
//! enter in f32: `scale * step * (hi + (256 * mid + lo) / 65536) + bias * sum(x)`, with the group's sum of the
//! unquantized activations.
//!
//! This file depends on `std` alone, so that it can be compiled for any target on its own.

/// Inputs per quantization group (weights and activations alike).
pub const GROUP: usize = 64;

/// The integer SIMD code path of the quantized dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    Scalar,
    Avx2,
    /// AVX-512 VNNI's `vpdpbusd`: 4-bit rows in pairs on 512-bit vectors, 8-bit rows on 256-bit vectors (needs
    /// AVX-512 F, BW, DQ, VL and VNNI).
    Avx512,
    /// NEON with `sdot` (the Armv8.2 dot-product extension).
    Neon,
}

impl Path {
    pub const ALL: [Path; 4] = [Path::Scalar, Path::Avx2, Path::Avx512, Path::Neon];

    pub fn name(self) -> &'static str {
        match self {
            Path::Scalar => "scalar",
            Path::Avx2 => "avx2",
            Path::Avx512 => "avx512",
            Path::Neon => "neon",
        }
    }

    pub fn from_name(name: &str) -> Option<Path> {
        Path::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            Path::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2 => std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Path::Avx512 => {
                Path::Avx2.is_available()
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512dq")
                    && std::is_x86_feature_detected!("avx512vnni")
                    && std::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "aarch64")]
            Path::Neon => std::arch::is_aarch64_feature_detected!("dotprod"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The paths this CPU can run, scalar first.
    pub fn available() -> Vec<Path> {
        Path::ALL.into_iter().filter(|p| p.is_available()).collect()
    }

    /// The fastest path this CPU can run.
    pub fn best() -> Path {
        [Path::Avx512, Path::Avx2, Path::Neon]
            .into_iter()
            .find(|p| p.is_available())
            .unwrap_or(Path::Scalar)
    }
}

/// One activation vector quantized for the dot products (see the module comment), reused from product to product
/// so that quantizing allocates nothing once it has held the widest vector.
#[derive(Clone, Default)]
pub struct QInput {
    /// Bits of the matrices this layout is for: the order of the values inside a group follows the packing.
    bits: u32,
    cols: usize,
    hi: Vec<i8>,
    mid: Vec<i8>,
    lo: Vec<i8>,
    /// Per group: the activation step (`hi` is in units of it).
    step: Vec<f32>,
    /// Per group: the sum of the unquantized activations (for the weights' bias).
    sum: Vec<f32>,
}

/// The position inside a group of 4-bit data where the kernels expect the activation of input `i`: packed byte
/// `j` holds inputs `2j` (low nibble) and `2j + 1` (high nibble), and the kernels split the 32 bytes into their
/// low and their high nibbles, so even inputs come first, then odd ones.
#[inline(always)]
fn position_4bit(i: usize) -> usize {
    (i & 1) * (GROUP / 2) + i / 2
}

impl QInput {
    pub const fn new() -> QInput {
        QInput {
            bits: 0,
            cols: 0,
            hi: Vec::new(),
            mid: Vec::new(),
            lo: Vec::new(),
            step: Vec::new(),
            sum: Vec::new(),
        }
    }

    pub fn bits(&self) -> u32 {
        self.bits
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Quantizes `x` (a multiple of [`GROUP`] long) for matrices of `bits` bits.
    pub fn quantize(&mut self, x: &[f32], bits: u32) {
        assert!(x.len().is_multiple_of(GROUP) && matches!(bits, 4 | 8));
        let groups = x.len() / GROUP;
        self.bits = bits;
        self.cols = x.len();
        self.hi.resize(x.len(), 0);
        self.mid.resize(x.len(), 0);
        self.lo.resize(x.len(), 0);
        self.step.resize(groups, 0.0);
        self.sum.resize(groups, 0.0);
        for (g, xs) in x.chunks_exact(GROUP).enumerate() {
            let (mut max, mut sum) = (0.0f32, 0.0f32);
            for &v in xs {
                max = max.max(v.abs());
                sum += v;
            }
            self.sum[g] = sum;
            let hi = &mut self.hi[g * GROUP..(g + 1) * GROUP];
            let mid = &mut self.mid[g * GROUP..(g + 1) * GROUP];
            let lo = &mut self.lo[g * GROUP..(g + 1) * GROUP];
            // A group of zeros (or of values too small to divide by) contributes nothing but its exact sum.
            if max < f32::MIN_POSITIVE * 128.0 || !max.is_finite() {
                self.step[g] = if max.is_finite() { 0.0 } else { f32::NAN };
                hi.fill(0);
                mid.fill(0);
                lo.fill(0);
                continue;
            }
            let step = max / 127.0;
            let inv = 127.0 / max;
            self.step[g] = step;
            for (i, &v) in xs.iter().enumerate() {
                // Each remainder is exact in f32; a clamped middle byte (a remainder of exactly half a step) leaves
                // one more 1/256th for the last byte, which it clamps in turn: an error of 1/65536th of a step.
                let t = v * inv;
                let h = t.round().clamp(-127.0, 127.0);
                let r = (t - h) * 256.0;
                let m = r.round().clamp(-128.0, 127.0);
                let l = ((r - m) * 256.0).round().clamp(-128.0, 127.0);
                let p = if bits == 4 { position_4bit(i) } else { i };
                hi[p] = h as i8;
                mid[p] = m as i8;
                lo[p] = l as i8;
            }
        }
    }
}

/// The rows of one matrix that a call reads: `packed` holds whole rows (`cols * bits / 8` bytes each), `scales` and
/// `biases` their groups' bf16 bits.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub bits: u32,
    pub cols: usize,
    pub packed: &'a [u8],
    pub scales: &'a [u16],
    pub biases: &'a [u16],
}

#[inline(always)]
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `out[r] = row r of w . x` for every row of `w`, on `path` (which must be available: see [`Path::is_available`]).
pub fn dot_rows(path: Path, w: Rows, x: &QInput, out: &mut [f32]) {
    let groups = w.cols / GROUP;
    assert!(matches!(w.bits, 4 | 8) && x.bits == w.bits && x.cols == w.cols && w.cols.is_multiple_of(GROUP));
    assert!(
        w.packed.len() == out.len() * w.cols * w.bits as usize / 8
            && w.scales.len() == out.len() * groups
            && w.biases.len() == out.len() * groups
    );
    assert!(
        path.is_available(),
        "the {} path needs CPU features this CPU lacks",
        path.name()
    );
    match path {
        Path::Scalar => dot_rows_scalar(w, x, out),
        // SAFETY (each arm): the CPU has the features the function is compiled for (checked above), and the slice
        // lengths the functions read within were checked above.
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { x86::dot_rows_avx2(w, x, out) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx512 => unsafe { x86::dot_rows_avx512(w, x, out) },
        #[cfg(target_arch = "aarch64")]
        Path::Neon => unsafe { arm::dot_rows_neon(w, x, out) },
        #[allow(unreachable_patterns)]
        _ => unreachable!("checked available above"),
    }
}

/// The bias term of one row: `sum over groups of bias * sum(x)`.
#[inline(always)]
fn bias_term(biases: &[u16], x: &QInput) -> f32 {
    biases.iter().zip(&x.sum).map(|(&b, &s)| bf16_to_f32(b) * s).sum()
}

fn dot_rows_scalar(w: Rows, x: &QInput, out: &mut [f32]) {
    let groups = w.cols / GROUP;
    let group_bytes = GROUP * w.bits as usize / 8;
    // Sum of q * x over one group's bytes for one of the three activation bytes.
    let dot = |bytes: &[u8], x: &[i8]| -> i32 {
        if w.bits == 4 {
            let mut acc = 0i32;
            for (j, &b) in bytes.iter().enumerate() {
                acc += (b & 0xF) as i32 * x[j] as i32 + (b >> 4) as i32 * x[GROUP / 2 + j] as i32;
            }
            acc
        } else {
            bytes.iter().zip(x).map(|(&b, &x)| b as i32 * x as i32).sum()
        }
    };
    for (r, o) in out.iter_mut().enumerate() {
        let mut total = 0.0f32;
        for g in 0..groups {
            let bytes = &w.packed[(r * groups + g) * group_bytes..(r * groups + g + 1) * group_bytes];
            let part = |v: &[i8]| dot(bytes, &v[g * GROUP..(g + 1) * GROUP]);
            let (h, ml) = (part(&x.hi), (part(&x.mid) << 8) + part(&x.lo));
            let factor = bf16_to_f32(w.scales[r * groups + g]) * x.step[g];
            total += factor * (h as f32 + ml as f32 * (1.0 / 65536.0));
        }
        *o = total + bias_term(&w.biases[r * groups..(r + 1) * groups], x);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{bf16_to_f32, bias_term, QInput, Rows, GROUP};

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// The i32 lanes of `sum q * x` over one group for AVX2, by `maddubs` (u8 x i8 pairs summed into i16: at most
    /// 2 * 255 * 128 with 8-bit weights, past i16, so these are split into nibbles first) and `madd` into i32. The
    /// weights come as their low and high nibbles (`q0`, `q1`: the 4-bit group's 32 bytes, or each 32-byte half of
    /// the 8-bit group's 64).
    #[inline(always)]
    unsafe fn dot_avx2(bits: u32, q0: [__m256i; 2], q1: [__m256i; 2], x: *const i8) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let load = |k: usize| _mm256_loadu_si256(x.add(32 * k) as *const __m256i);
        if bits == 4 {
            let s = _mm256_add_epi16(
                _mm256_maddubs_epi16(q0[0], load(0)),
                _mm256_maddubs_epi16(q1[0], load(1)),
            );
            _mm256_madd_epi16(s, ones)
        } else {
            let (x0, x1) = (load(0), load(1));
            let low = _mm256_add_epi16(_mm256_maddubs_epi16(q0[0], x0), _mm256_maddubs_epi16(q0[1], x1));
            let high = _mm256_add_epi16(_mm256_maddubs_epi16(q1[0], x0), _mm256_maddubs_epi16(q1[1], x1));
            _mm256_add_epi32(
                _mm256_madd_epi16(low, ones),
                _mm256_slli_epi32(_mm256_madd_epi16(high, ones), 4),
            )
        }
    }

    /// The same with VNNI's `vpdpbusd` (u8 x i8 quadruples summed straight into i32, no saturation), on the 4-bit
    /// group's nibbles (`q0`, `q1`) or the 8-bit group's two 32-byte halves (`v`).
    #[inline(always)]
    unsafe fn dot_vnni(bits: u32, q0: [__m256i; 2], q1: [__m256i; 2], v: [__m256i; 2], x: *const i8) -> __m256i {
        let load = |k: usize| _mm256_loadu_si256(x.add(32 * k) as *const __m256i);
        let zero = _mm256_setzero_si256();
        if bits == 4 {
            _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, q0[0], load(0)), q1[0], load(1))
        } else {
            _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, v[0], load(0)), v[1], load(1))
        }
    }

    /// How far ahead of the group being multiplied the row loop asks for weight bytes (`prefetcht0`). A decode
    /// step streams each matrix once from memory, and the hardware prefetchers alone leave a core waiting on its
    /// loads (bench/RESULTS.md has the figures). The rows of a task are contiguous, so the bytes ahead are the
    /// task's next rows; past its end they are rows another thread takes (brought into the shared cache) or, at
    /// a matrix's end, bytes nobody reads, which costs a little bandwidth and never faults.
    const PREFETCH_BYTES: usize = 4096;

    /// The row loop shared by both x86 paths (inlined into each, so compiled with its features): per group, the
    /// three dot products (`hi`, and `mid` and `lo` combined in i32) converted to f32 and scaled into 8 f32 lanes,
    /// summed once per row.
    #[inline(always)]
    unsafe fn rows<const VNNI: bool>(w: Rows, x: &QInput, out: &mut [f32]) {
        let groups = w.cols / GROUP;
        let group_bytes = GROUP * w.bits as usize / 8;
        let mask = _mm256_set1_epi8(0x0F);
        let (hi, mid, lo) = (x.hi.as_ptr(), x.mid.as_ptr(), x.lo.as_ptr());
        for (r, o) in out.iter_mut().enumerate() {
            let row = w.packed.as_ptr().add(r * groups * group_bytes);
            let scales = &w.scales[r * groups..(r + 1) * groups];
            let mut acc = _mm256_setzero_ps();
            for (g, &scale) in scales.iter().enumerate() {
                let bytes = row.add(g * group_bytes);
                _mm_prefetch::<_MM_HINT_T0>(bytes.wrapping_add(PREFETCH_BYTES) as *const i8);
                let v0 = _mm256_loadu_si256(bytes as *const __m256i);
                let v1 = if w.bits == 8 {
                    _mm256_loadu_si256(bytes.add(32) as *const __m256i)
                } else {
                    v0
                };
                let v = [v0, v1];
                let q0 = [_mm256_and_si256(v0, mask), _mm256_and_si256(v1, mask)];
                let q1 = [
                    _mm256_and_si256(_mm256_srli_epi16(v0, 4), mask),
                    _mm256_and_si256(_mm256_srli_epi16(v1, 4), mask),
                ];
                let dot = |x: *const i8| {
                    if VNNI {
                        dot_vnni(w.bits, q0, q1, v, x.add(g * GROUP))
                    } else {
                        dot_avx2(w.bits, q0, q1, x.add(g * GROUP))
                    }
                };
                let h = dot(hi);
                let ml = _mm256_add_epi32(_mm256_slli_epi32(dot(mid), 8), dot(lo));
                let combined = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(ml),
                    _mm256_set1_ps(1.0 / 65536.0),
                    _mm256_cvtepi32_ps(h),
                );
                let factor = bf16_to_f32(scale) * x.step[g];
                acc = _mm256_fmadd_ps(combined, _mm256_set1_ps(factor), acc);
            }
            *o = hsum(acc) + bias_term(&w.biases[r * groups..(r + 1) * groups], x);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_rows_avx2(w: Rows, x: &QInput, out: &mut [f32]) {
        rows::<false>(w, x, out)
    }

    /// The 4-bit rows two at a time on 512-bit vectors: the low 256 bits carry row `r`'s group, the high 256 bits
    /// row `r + 1`'s, against the group's activations in both halves. Every lane computes what [`rows`] computes for
    /// its row, in the same order (exact integer sums, then the same f32 operations, one 8-lane sum per row), so the
    /// results are bit for bit those of the 256-bit loop, in half the instructions per group.
    #[inline(always)]
    unsafe fn row_pairs_4bit(w: Rows, x: &QInput, out: &mut [f32]) {
        let groups = w.cols / GROUP;
        let row_bytes = groups * GROUP / 2;
        let mask = _mm512_set1_epi8(0x0F);
        let zero = _mm512_setzero_si512();
        let (hi, mid, lo) = (x.hi.as_ptr(), x.mid.as_ptr(), x.lo.as_ptr());
        let pairs = out.len() / 2;
        for pair in 0..pairs {
            let r = 2 * pair;
            let row0 = w.packed.as_ptr().add(r * row_bytes);
            let row1 = row0.add(row_bytes);
            let (scales0, scales1) = (&w.scales[r * groups..], &w.scales[(r + 1) * groups..]);
            let mut acc = _mm512_setzero_ps();
            for g in 0..groups {
                _mm_prefetch::<_MM_HINT_T0>(row0.wrapping_add(g * 64 + PREFETCH_BYTES) as *const i8);
                let v = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256(row0.add(g * 32) as *const __m256i)),
                    _mm256_loadu_si256(row1.add(g * 32) as *const __m256i),
                    1,
                );
                let q0 = _mm512_and_si512(v, mask);
                let q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                let both = |p: *const i8| _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i));
                let dot = |x: *const i8| {
                    let x = x.add(g * GROUP);
                    _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, q0, both(x)), q1, both(x.add(32)))
                };
                let h = dot(hi);
                let ml = _mm512_add_epi32(_mm512_slli_epi32(dot(mid), 8), dot(lo));
                let combined = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(ml),
                    _mm512_set1_ps(1.0 / 65536.0),
                    _mm512_cvtepi32_ps(h),
                );
                let step = x.step[g];
                let factors = _mm512_insertf32x8(
                    _mm512_set1_ps(bf16_to_f32(scales0[g]) * step),
                    _mm256_set1_ps(bf16_to_f32(scales1[g]) * step),
                    1,
                );
                acc = _mm512_fmadd_ps(combined, factors, acc);
            }
            let halves = [_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)];
            for (i, half) in halves.into_iter().enumerate() {
                let biases = &w.biases[(r + i) * groups..(r + i + 1) * groups];
                out[r + i] = hsum(half) + bias_term(biases, x);
            }
        }
        if out.len() % 2 == 1 {
            let r = out.len() - 1;
            let last = Rows {
                packed: &w.packed[r * row_bytes..],
                scales: &w.scales[r * groups..],
                biases: &w.biases[r * groups..],
                ..w
            };
            rows::<true>(last, x, &mut out[r..]);
        }
    }

    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512dq,avx512vnni,avx512vl")]
    pub(super) unsafe fn dot_rows_avx512(w: Rows, x: &QInput, out: &mut [f32]) {
        if w.bits == 4 {
            row_pairs_4bit(w, x, out)
        } else {
            rows::<true>(w, x, out)
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;

    use super::{bf16_to_f32, bias_term, QInput, Rows, GROUP};

    /// `acc += ` the dot products of each 4 bytes of `a` and `b` (`sdot`; written as assembly because the
    /// intrinsic is not yet in stable Rust).
    #[inline(always)]
    unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        std::arch::asm!(
            ".arch_extension dotprod",
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    /// The i32 lanes of `sum q * x` over one group (the 4-bit values are below 16, so they are valid signed bytes;
    /// 8-bit values are split into nibbles). `q0`, `q1`: the low and high nibbles of each 16 bytes of the group.
    #[inline(always)]
    unsafe fn dot(bits: u32, q0: &[int8x16_t; 4], q1: &[int8x16_t; 4], x: *const i8) -> int32x4_t {
        let zero = vdupq_n_s32(0);
        if bits == 4 {
            let mut acc = zero;
            for k in 0..2 {
                acc = sdot(acc, q0[k], vld1q_s8(x.add(16 * k)));
                acc = sdot(acc, q1[k], vld1q_s8(x.add(GROUP / 2 + 16 * k)));
            }
            acc
        } else {
            let (mut low, mut high) = (zero, zero);
            for k in 0..4 {
                let xk = vld1q_s8(x.add(16 * k));
                low = sdot(low, q0[k], xk);
                high = sdot(high, q1[k], xk);
            }
            vaddq_s32(low, vshlq_n_s32(high, 4))
        }
    }

    #[target_feature(enable = "neon,dotprod")]
    pub(super) unsafe fn dot_rows_neon(w: Rows, x: &QInput, out: &mut [f32]) {
        let groups = w.cols / GROUP;
        let group_bytes = GROUP * w.bits as usize / 8;
        let mask = vdupq_n_u8(0x0F);
        let (hi, mid, lo) = (x.hi.as_ptr(), x.mid.as_ptr(), x.lo.as_ptr());
        for (r, o) in out.iter_mut().enumerate() {
            let row = w.packed.as_ptr().add(r * groups * group_bytes);
            let scales = &w.scales[r * groups..(r + 1) * groups];
            let mut acc = vdupq_n_f32(0.0);
            for (g, &scale) in scales.iter().enumerate() {
                let bytes = row.add(g * group_bytes);
                let (mut q0, mut q1) = ([vdupq_n_s8(0); 4], [vdupq_n_s8(0); 4]);
                for k in 0..group_bytes / 16 {
                    let v = vld1q_u8(bytes.add(16 * k));
                    q0[k] = vreinterpretq_s8_u8(vandq_u8(v, mask));
                    q1[k] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
                }
                let h = dot(w.bits, &q0, &q1, hi.add(g * GROUP));
                let ml = vaddq_s32(
                    vshlq_n_s32(dot(w.bits, &q0, &q1, mid.add(g * GROUP)), 8),
                    dot(w.bits, &q0, &q1, lo.add(g * GROUP)),
                );
                let combined = vfmaq_n_f32(vcvtq_f32_s32(h), vcvtq_f32_s32(ml), 1.0 / 65536.0);
                acc = vfmaq_n_f32(acc, combined, bf16_to_f32(scale) * x.step[g]);
            }
            *o = vaddvq_f32(acc) + bias_term(&w.biases[r * groups..(r + 1) * groups], x);
        }
    }
}
