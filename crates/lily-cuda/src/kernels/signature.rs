//! What a launcher passes to its kernel, written once per kernel with [`launchers!`]: the typed launcher function
//! and a [`Signature`] (each parameter's C type, size and alignment). Two checks hold the signatures to the kernels:
//! at load time against the compiled kernel's parameter layout (`cuFuncGetParamInfo`; see
//! [`Signature::check_layout`]), and in a CPU test against the `extern "C"` declarations of the `.cu` files (see
//! [`check_against_sources`]).

use half::{bf16, f16};
use lily_model::config::GROUP_SIZE;

use crate::driver::DevPtr;

/// A parameter's C type as the kernels spell it (after `common.cuh`'s typedefs, without `const`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CType {
    /// A value passed by copy: `int`, `float`, `u64` or the `Q4` and `Q8x2` structs.
    Value(&'static str),
    /// A pointer to values of the named type.
    Pointer(&'static str),
}

impl std::fmt::Display for CType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CType::Value(t) => write!(f, "{t}"),
            CType::Pointer(t) => write!(f, "{t}*"),
        }
    }
}

/// One parameter of a kernel, as its launcher passes it.
#[derive(Clone, Copy, Debug)]
pub struct Param {
    pub name: &'static str,
    pub c_type: CType,
    pub size: usize,
    pub align: usize,
}

/// A kernel's name and parameters, as its launcher passes them.
#[derive(Clone, Copy, Debug)]
pub struct Signature<'a> {
    pub name: &'a str,
    pub params: &'a [Param],
}

impl Signature<'_> {
    /// The (offset, size) of each parameter in the kernel's parameter buffer, by the C rules: each parameter at
    /// the next multiple of its alignment.
    pub fn layout(&self) -> Vec<(usize, usize)> {
        self.layout_at(0)
    }

    /// The same for a parameter buffer that starts `base` bytes past a multiple of 64: the alignments hold for the
    /// addresses, and the offsets are counted from the buffer's start.
    fn layout_at(&self, base: usize) -> Vec<(usize, usize)> {
        let mut end = 0usize;
        self.params
            .iter()
            .map(|p| {
                let offset = (base + end).next_multiple_of(p.align) - base;
                end = offset + p.size;
                (offset, p.size)
            })
            .collect()
    }

    /// Compares the launcher's layout with the one the driver reports for the compiled kernel (`reported`, in
    /// parameter order); the error names the kernel and the first difference. The driver's parameter buffer need
    /// not start on a multiple of a parameter's alignment (a tensor map's 64 bytes: the H200's driver reports a
    /// kernel's maps from offset 48), so the launcher's layout must equal the reported one for some start of the
    /// buffer (a multiple of 4 below 64); an error compares with the start that places the first parameter right.
    pub fn check_layout(&self, reported: &[(usize, usize)]) -> Result<(), String> {
        let starts: Vec<Vec<(usize, usize)>> = (0..64).step_by(4).map(|b| self.layout_at(b)).collect();
        let declared = starts
            .iter()
            .find(|l| l.as_slice() == reported)
            .or_else(|| starts.iter().find(|l| l.first() == reported.first()))
            .cloned()
            .unwrap_or_else(|| self.layout());
        if declared.len() != reported.len() {
            return Err(format!(
                "kernel {}: its launcher passes {} parameters, the compiled kernel takes {}",
                self.name,
                declared.len(),
                reported.len()
            ));
        }
        for (i, (d, r)) in declared.iter().zip(reported).enumerate() {
            if d != r {
                return Err(format!(
                    "kernel {}: parameter {i} ({}) is {} bytes at offset {} in its launcher, {} bytes at offset {} in \
                     the compiled kernel",
                    self.name, self.params[i].name, d.1, d.0, r.1, r.0
                ));
            }
        }
        Ok(())
    }
}

/// A type a kernel reads through a pointer, by its C name.
pub trait DeviceType {
    const C_NAME: &'static str;
}

impl DeviceType for f32 {
    const C_NAME: &'static str = "float";
}
impl DeviceType for i8 {
    const C_NAME: &'static str = "i8";
}
impl DeviceType for u8 {
    const C_NAME: &'static str = "u8";
}
impl DeviceType for i32 {
    const C_NAME: &'static str = "int";
}
impl DeviceType for u32 {
    const C_NAME: &'static str = "u32";
}
impl DeviceType for u64 {
    const C_NAME: &'static str = "u64";
}
impl DeviceType for bf16 {
    const C_NAME: &'static str = "bf16";
}
impl DeviceType for f16 {
    const C_NAME: &'static str = "f16";
}

/// A value a launcher passes to a kernel: its C type, its size and alignment in the parameter buffer, and its
/// bytes (at most 16, in one slot of [`crate::driver::Args`]; a [`TensorMap`] has slots of its own).
pub trait KernelArg: Copy {
    const C_TYPE: CType;
    const SIZE: usize;
    const ALIGN: usize;
    fn slot(self) -> [u64; 2];
    /// The tensor map this argument is, if it is one.
    fn tensor_map(self) -> Option<TensorMap> {
        None
    }
}

/// A tensor map for the tensor memory accelerator, as [`crate::driver::Gpu::tensor_map_2d`] encodes it: the driver's
/// 128 opaque bytes, 64-byte aligned (common.cuh's `TmaMap`, which a kernel takes as a `const __grid_constant__`
/// parameter).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct TensorMap {
    pub(crate) words: [u64; 16],
}

impl std::fmt::Debug for TensorMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TensorMap")
    }
}

impl KernelArg for TensorMap {
    const C_TYPE: CType = CType::Value("TmaMap");
    const SIZE: usize = 128;
    const ALIGN: usize = 64;
    fn slot(self) -> [u64; 2] {
        [0, 0]
    }
    fn tensor_map(self) -> Option<TensorMap> {
        Some(self)
    }
}

impl<T: DeviceType> KernelArg for DevPtr<T> {
    const C_TYPE: CType = CType::Pointer(T::C_NAME);
    const SIZE: usize = 8;
    const ALIGN: usize = 8;
    fn slot(self) -> [u64; 2] {
        [self.raw(), 0]
    }
}

impl KernelArg for i32 {
    const C_TYPE: CType = CType::Value("int");
    const SIZE: usize = 4;
    const ALIGN: usize = 4;
    fn slot(self) -> [u64; 2] {
        [self as u32 as u64, 0]
    }
}

impl KernelArg for f32 {
    const C_TYPE: CType = CType::Value("float");
    const SIZE: usize = 4;
    const ALIGN: usize = 4;
    fn slot(self) -> [u64; 2] {
        [self.to_bits() as u64, 0]
    }
}

impl KernelArg for u64 {
    const C_TYPE: CType = CType::Value("u64");
    const SIZE: usize = 8;
    const ALIGN: usize = 8;
    fn slot(self) -> [u64; 2] {
        [self, 0]
    }
}

/// A quantized matrix as the kernels take it (common.cuh's `Q4`, also used for 8-bit): its packed rows and its
/// (scale, bias) bf16 pairs.
#[derive(Clone, Copy, Debug)]
pub struct Q4 {
    pub packed: DevPtr<u32>,
    pub scale_bias: DevPtr<u32>,
}

impl KernelArg for Q4 {
    const C_TYPE: CType = CType::Value("Q4");
    const SIZE: usize = 16;
    const ALIGN: usize = 8;
    fn slot(self) -> [u64; 2] {
        [self.packed.raw(), self.scale_bias.raw()]
    }
}

/// Rows of activations as the grouped expert products' small tiling takes them (gemm.cu's `Q8x2`): two 8-bit
/// digits an input as u32 words, and a (scale, sum) f32 pair a group of 64 inputs.
#[derive(Clone, Copy, Debug)]
pub struct Q8x2 {
    pub codes: DevPtr<u32>,
    pub pairs: DevPtr<f32>,
}

impl Q8x2 {
    /// No rows: a kernel given it codes none.
    pub const NONE: Q8x2 = Q8x2 {
        codes: DevPtr::NULL,
        pairs: DevPtr::NULL,
    };

    /// The same rows from row `row` on, for rows of `k` inputs (a whole number of groups); [`Q8x2::NONE`] stays
    /// itself.
    pub fn from_row(self, row: usize, k: usize) -> Q8x2 {
        assert!(
            k.is_multiple_of(GROUP_SIZE),
            "Q8x2 rows are whole groups of {GROUP_SIZE} inputs, not {k}"
        );
        if self.codes.raw() == 0 {
            return self;
        }
        Q8x2 {
            codes: self.codes.offset(row * k / 2),
            pairs: self.pairs.offset(row * k / GROUP_SIZE * 2),
        }
    }
}

impl KernelArg for Q8x2 {
    const C_TYPE: CType = CType::Value("Q8x2");
    const SIZE: usize = 16;
    const ALIGN: usize = 8;
    fn slot(self) -> [u64; 2] {
        [self.codes.raw(), self.pairs.raw()]
    }
}

/// Declares a kernel family's launchers: for each `name(param: Type, ...)`, a function `name(l, dims, param, ...)`
/// that queues the kernel through the [`crate::launch::Launcher`], and the family's `KERNELS` table of
/// [`Signature`]s that the load-time and CPU checks compare with the kernel.
macro_rules! launchers {
    ($( $(#[$doc:meta])* $name:ident ( $($arg:ident : $ty:ty),* $(,)? ); )*) => {
        /// This family's kernels, as their launchers pass them.
        pub const KERNELS: &[$crate::kernels::Signature<'static>] = &[$(
            $crate::kernels::Signature {
                name: stringify!($name),
                params: &[$(
                    $crate::kernels::Param {
                        name: stringify!($arg),
                        c_type: <$ty as $crate::kernels::KernelArg>::C_TYPE,
                        size: <$ty as $crate::kernels::KernelArg>::SIZE,
                        align: <$ty as $crate::kernels::KernelArg>::ALIGN,
                    },
                )*],
            },
        )*];
        $(
            $(#[$doc])*
            #[allow(clippy::too_many_arguments)]
            pub fn $name(
                l: &mut $crate::launch::Launcher,
                dims: $crate::launch::Dims,
                $($arg: $ty),*
            ) -> $crate::driver::Result<()> {
                let args = $crate::driver::Args::new() $(.arg($arg))*;
                l.launch(stringify!($name), dims, args)
            }
        )*
    };
}
pub(crate) use launchers;

/// The `extern "C" __global__` kernels of a `.cu` source: each one's name and parameter types, in order.
/// `unsigned` (`unsigned int`) reads as `u32`, its typedef in common.cuh.
pub fn declarations(source: &str) -> Vec<(String, Vec<String>)> {
    const START: &str = "extern \"C\" __global__";
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find(START) {
        rest = &rest[at + START.len()..];
        let Some(body) = rest.find('{') else { break };
        let head = rest[..body].trim_end();
        // The parameter list is the last parenthesised group before the body; the name precedes it.
        let Some(close) = head.rfind(')') else { continue };
        let mut depth = 0;
        let mut open = close;
        for (i, ch) in head[..=close].char_indices().rev() {
            match ch {
                ')' => depth += 1,
                '(' => {
                    depth -= 1;
                    if depth == 0 {
                        open = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let name = head[..open]
            .trim_end()
            .rsplit(|c: char| !(c.is_alphanumeric() || c == '_'))
            .next()
            .unwrap_or("")
            .to_string();
        let params = head[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                let pointer = p.contains('*');
                let words: Vec<&str> = p
                    .split(|c: char| c.is_whitespace() || c == '*')
                    .filter(|w| !w.is_empty() && !["const", "__restrict__", "__grid_constant__"].contains(w))
                    .collect();
                // All words but the last (the parameter's name) make the type.
                let base = match words[..words.len().saturating_sub(1)].join(" ").as_str() {
                    "unsigned" | "unsigned int" => "u32".to_string(),
                    other => other.to_string(),
                };
                if pointer {
                    format!("{base}*")
                } else {
                    base
                }
            })
            .collect();
        out.push((name, params));
    }
    out
}

/// Every family's launchers against its `.cu` declarations: every declared kernel has a launcher and every launcher
/// a declared kernel, with the same parameter types in the same order. Returns each difference found.
pub fn check_against_sources(files: &[crate::kernels::KernelFile<'_>]) -> Vec<String> {
    let mut problems = Vec::new();
    for file in files {
        let declared = declarations(file.source);
        for (name, _) in &declared {
            if !file.kernels.iter().any(|s| s.name == name) {
                problems.push(format!("{}: kernel {name} has no launcher", file.name));
            }
        }
        for sig in file.kernels {
            if sig.params.len() > crate::driver::MAX_ARGS {
                problems.push(format!(
                    "kernel {}: {} parameters, more than a launch passes ({})",
                    sig.name,
                    sig.params.len(),
                    crate::driver::MAX_ARGS
                ));
            }
            match declared.iter().find(|(name, _)| name == sig.name) {
                None => problems.push(format!("{}: no kernel {} for its launcher", file.name, sig.name)),
                Some((_, types)) => {
                    let wanted: Vec<String> = sig.params.iter().map(|p| p.c_type.to_string()).collect();
                    if wanted.len() != types.len() {
                        problems.push(format!(
                            "kernel {}: its launcher passes {} parameters, the .cu declaration takes {}",
                            sig.name,
                            wanted.len(),
                            types.len()
                        ));
                    } else if let Some(i) = (0..types.len()).find(|&i| wanted[i] != types[i]) {
                        problems.push(format!(
                            "kernel {}: parameter {i} ({}) is {} in its launcher, {} in the .cu declaration",
                            sig.name, sig.params[i].name, wanted[i], types[i]
                        ));
                    }
                }
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{KernelFile, FILES};

    /// `sig` with its parameter `drop` left out.
    fn without_param(sig: &Signature, drop: usize) -> Vec<Param> {
        let mut params = sig.params.to_vec();
        params.remove(drop);
        params
    }

    fn signature(name: &str) -> &'static Signature<'static> {
        FILES
            .iter()
            .flat_map(|f| f.kernels)
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no launcher for {name}"))
    }

    /// CI's check that nothing ties launchers and kernels together but this: every launcher passes exactly the
    /// parameter types its kernel's `extern "C"` declaration takes, and every kernel has a launcher.
    #[test]
    fn every_launcher_matches_its_kernel_declaration() {
        let problems = check_against_sources(FILES);
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        let kernels: usize = FILES.iter().map(|f| declarations(f.source).len()).sum();
        assert_eq!(kernels, FILES.iter().map(|f| f.kernels.len()).sum::<usize>());
        assert!(kernels >= 30, "only {kernels} kernels parsed");
    }

    /// A launcher with one argument dropped is refused by the source check, naming the kernel.
    #[test]
    fn a_launcher_missing_an_argument_fails_the_source_check() {
        let sig = signature("route_rows");
        let params = without_param(sig, 2);
        let wrong = Signature {
            name: sig.name,
            params: &params,
        };
        let file = FILES.iter().find(|f| f.name == "prefill.cu").expect("prefill.cu");
        let kernels: Vec<Signature> = file
            .kernels
            .iter()
            .map(|s| if s.name == "route_rows" { wrong } else { *s })
            .collect();
        let broken = KernelFile {
            kernels: &kernels,
            ..*file
        };
        let problems = check_against_sources(std::slice::from_ref(&broken));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("kernel route_rows") && problems[0].contains("passes 6 parameters"),
            "{}",
            problems[0]
        );
    }

    /// The load-time comparison: the layout a compiled kernel reports (here written out as the driver reports it
    /// for route_rows: a pointer at 0, the int at 8, four pointers from 16, then an int at 48) accepts the right
    /// launcher and refuses one with an argument dropped, naming the kernel.
    #[test]
    fn a_launcher_missing_an_argument_fails_the_layout_check() {
        let sig = signature("route_rows");
        let reported = [(0, 8), (8, 4), (16, 8), (24, 8), (32, 8), (40, 8), (48, 4)];
        assert_eq!(sig.layout(), reported);
        assert_eq!(sig.check_layout(&reported), Ok(()));
        let params = without_param(sig, 2);
        let dropped = Signature {
            name: sig.name,
            params: &params,
        };
        let err = dropped.check_layout(&reported).unwrap_err();
        assert!(
            err.starts_with("kernel route_rows:") && err.contains("passes 6 parameters"),
            "{err}"
        );
        // Same count, a wrong size: an i32 where the kernel takes a pointer.
        let mut params = sig.params.to_vec();
        params[2] = Param {
            name: "route_ids",
            c_type: CType::Value("int"),
            size: 4,
            align: 4,
        };
        let swapped = Signature {
            name: sig.name,
            params: &params,
        };
        let err = swapped.check_layout(&reported).unwrap_err();
        assert!(
            err.contains("kernel route_rows: parameter 2 (route_ids) is 4 bytes"),
            "{err}"
        );
    }

    /// The Q4 struct takes 16 bytes at an 8-byte boundary: `gemm_q4`'s `w` follows an int at offset 8 and lands
    /// at 16.
    #[test]
    fn a_q4_after_an_int_is_aligned_to_8_bytes() {
        let layout = signature("gemm_q4").layout();
        assert_eq!(&layout[..4], &[(0, 8), (8, 4), (16, 16), (32, 4)]);
    }

    /// Tensor maps are 128 bytes at 64-byte boundaries. The H200's driver reports `gemm_q4_wgmma_tma`'s parameters
    /// 48 bytes on (the padding to the first 64-byte boundary of its parameter buffer): accepted, while a layout that
    /// differs elsewhere is still refused.
    #[test]
    fn tensor_maps_may_start_past_the_parameter_space_start() {
        let sig = signature("gemm_q4_wgmma_tma");
        let layout = sig.layout();
        assert_eq!(&layout[..5], &[(0, 128), (128, 128), (256, 128), (384, 4), (388, 4)]);
        let shifted: Vec<(usize, usize)> = layout.iter().map(|&(o, n)| (o + 48, n)).collect();
        assert_eq!(sig.check_layout(&shifted), Ok(()));
        let mut wrong = shifted.clone();
        wrong[4].0 += 4;
        let err = sig.check_layout(&wrong).unwrap_err();
        assert!(err.contains("parameter 4 (n)"), "{err}");
        // A map after an int: from a buffer start 16 bytes past a multiple of 64, the map lies at 48, not 64.
        let params = [sig.params[3], sig.params[0]];
        let int_then_map = Signature {
            name: "k",
            params: &params,
        };
        assert_eq!(int_then_map.layout(), [(0, 4), (64, 128)]);
        assert_eq!(int_then_map.check_layout(&[(0, 4), (48, 128)]), Ok(()));
        assert!(int_then_map.check_layout(&[(0, 4), (48, 64)]).is_err());
    }

    #[test]
    fn declarations_parse_launch_bounds_and_const() {
        let src = "extern \"C\" __global__ void __launch_bounds__(A, 2)\n    k(const float* x, int n, Q4 w,\n \
                   unsigned* done) {\n  f(1, 2);\n}\nextern \"C\" __device__ const int c = 1;\n\
                   extern \"C\" __global__ void g(u64 s) { }";
        let d = declarations(src);
        assert_eq!(
            d,
            vec![
                (
                    "k".to_string(),
                    vec!["float*".to_string(), "int".into(), "Q4".into(), "u32*".into()]
                ),
                ("g".to_string(), vec!["u64".to_string()]),
            ]
        );
    }

    /// Row `row` of Q8x2 rows of `k` inputs starts `k / 2` words of codes (two bytes an input) and `k / 64` pairs
    /// of f32 into the buffers; rows coded nowhere stay so.
    #[test]
    fn q8x2_rows_from_a_row_on() {
        let rows = Q8x2 {
            codes: DevPtr::from_raw(0x1_0000),
            pairs: DevPtr::from_raw(0x2_0000),
        };
        let from = rows.from_row(3, 4096);
        assert_eq!(from.codes.raw(), 0x1_0000 + 3 * 4096 * 2);
        assert_eq!(from.pairs.raw(), 0x2_0000 + 3 * (4096 / 64) * 2 * 4);
        let none = Q8x2::NONE.from_row(3, 4096);
        assert_eq!((none.codes.raw(), none.pairs.raw()), (0, 0));
    }
}
