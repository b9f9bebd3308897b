//! The CUDA kernels: `.cu` files embedded in the binary, compiled at start-up with NVRTC for the GPU's
//! architecture and the model's dimensions, cached on disk.
//!
//! Every file gets `common.cuh` in front and the model's dimensions as `-D` defines, so the tiny models run the
//! very kernels the full one does; the two attention files also get `attention_tiles.cuh` (their shared-memory rows,
//! cp.async and mma.sync helpers). On Hopper the target is `sm_90a` (machine code, no JIT); on other GPUs
//! `compute_XY` PTX that the driver compiles. The cache key hashes source, options, target and driver version.
//!
//! Each family's module (`matvec`, `moe`, ...) declares its kernels' typed launchers; loading checks every launcher
//! against the compiled kernel's parameters and refuses to start on a mismatch, naming the kernel.

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::path::PathBuf;

use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc;
use lily_model::rng::mix64;
use lily_model::Config;

use crate::driver::{check, DevPtr, Gpu, GpuError, Kernel, Result};

pub mod attention;
pub mod attention_prefill;
pub mod deltanet;
pub mod deltanet_prefill;
pub mod gemm;
pub mod layout;
pub mod matvec;
pub mod moe;
pub mod prefill;
pub mod sampling;
pub mod signature;
pub mod synth;

pub use signature::{CType, KernelArg, Param, Q8x2, Signature, TensorMap, Q4};

const COMMON: &str = include_str!("../../kernels/common.cuh");

/// A kernel family: one `.cu` file, its kernels as their launchers declare them, and its integer constants.
pub struct KernelFile<'a> {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'a [Signature<'a>],
    pub constants: &'static [&'static str],
    /// Device buffers the file defines (`__device__` arrays) that other kernels are given the address of.
    pub buffers: &'static [&'static str],
}

/// Every kernel family, in the order they are compiled and loaded.
pub const FILES: &[KernelFile<'static>] = &[
    matvec::FILE,
    moe::FILE,
    deltanet::FILE,
    attention::FILE,
    sampling::FILE,
    gemm::FILE,
    deltanet_prefill::FILE,
    attention_prefill::FILE,
    prefill::FILE,
    synth::FILE,
    layout::FILE,
];

/// Parts each KV head's context is split into by the attention decode kernel.
pub const ATTN_SPLITS: usize = 256;

/// The `-D` defines that specialise the kernels to a model.
pub fn defines(c: &Config) -> Vec<(String, String)> {
    let n = |v: usize| v.to_string();
    vec![
        ("HIDDEN".into(), n(c.hidden_size)),
        ("VOCAB".into(), n(c.vocab_size)),
        ("N_HEADS".into(), n(c.num_attention_heads)),
        ("N_KV_HEADS".into(), n(c.num_key_value_heads)),
        ("HEAD_DIM".into(), n(c.head_dim)),
        ("ROT_DIM".into(), n(c.rotary_dim())),
        ("Q_DIM".into(), n(c.q_dim())),
        ("KV_DIM".into(), n(c.kv_dim())),
        ("LIN_K_HEADS".into(), n(c.linear_num_key_heads)),
        ("LIN_V_HEADS".into(), n(c.linear_num_value_heads)),
        ("LIN_HEAD_DIM".into(), n(c.linear_key_head_dim)),
        ("LIN_K_DIM".into(), n(c.linear_key_dim())),
        ("LIN_V_DIM".into(), n(c.linear_value_dim())),
        ("LIN_CONV_DIM".into(), n(c.linear_conv_dim())),
        ("CONV_K".into(), n(c.linear_conv_kernel_dim)),
        ("NUM_EXPERTS".into(), n(c.num_experts)),
        ("TOP_K".into(), n(c.num_experts_per_tok)),
        ("MOE_INTER".into(), n(c.moe_intermediate_size)),
        ("SHARED_INTER".into(), n(c.shared_expert_intermediate_size)),
        ("RMS_EPS".into(), format!("{:e}f", c.rms_norm_eps)),
        ("ATTN_SPLITS".into(), n(ATTN_SPLITS)),
        // The host sampler's run of sums and head, which the GPU sampler repeats (the head is also its candidate
        // slots, so the largest top-k it draws).
        ("WHOLE_RUN".into(), n(lily_model::sampling::WHOLE_RUN)),
        ("SAMPLE_HEAD".into(), n(lily_model::sampling::HEAD)),
    ]
}

/// What NVRTC compiles for: machine code for an `sm_` target, PTX for a `compute_` one.
#[derive(Clone, Debug)]
pub struct Target {
    pub arch: String,
}

impl Target {
    pub fn for_device(cc: (i32, i32)) -> Target {
        match cc {
            (9, 0) => Target { arch: "sm_90a".into() },
            (major, minor) => Target {
                arch: format!("compute_{major}{minor}"),
            },
        }
    }
    fn is_machine_code(&self) -> bool {
        self.arch.starts_with("sm_")
    }
    /// Whether the kernels built for this target have Hopper's warpgroup instructions (`__CUDA_ARCH_FEAT_SM90_ALL`),
    /// which the `*_wgmma` and `attn_prefill_i8` kernels need.
    pub fn has_sm90a_features(&self) -> bool {
        self.arch == "sm_90a"
    }
}

/// Kernels loaded after this call note when each one's wait returned (`lily bench --timeline`; see
/// [`crate::bench::timeline`]). They are compiled separately from (and cached beside) the plain ones.
pub fn enable_timeline() {
    TIMELINE.store(true, std::sync::atomic::Ordering::Relaxed);
}
static TIMELINE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn options(config: &Config, target: &Target, timeline: bool) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={}", target.arch),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ];
    if std::env::var_os("LILY_PTXAS_VERBOSE").is_some() {
        opts.push("--ptxas-options=-v".into());
    }
    if timeline {
        opts.push("-DLILY_TIMELINE".into());
    }
    opts.extend(defines(config).into_iter().map(|(k, v)| format!("-D{k}={v}")));
    opts.extend(tuning_defines());
    opts
}

/// The kernel switches a command line chose (see [`set_switch`]), by name.
static SWITCHES: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

/// Compiles every kernel from now on with `name` defined as `value`, as if `LILY_KERNEL_DEFINES` said so and in
/// place of what it says for `name`: how a command-line option (`--attention-values`) turns a kernel file's switch.
/// Call it before the first kernel is compiled.
pub fn set_switch(name: &str, value: &str) {
    let mut switches = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    switches.retain(|(n, _)| n != name);
    switches.push((name.to_string(), value.to_string()));
}

/// Extra `-D` defines from `LILY_KERNEL_DEFINES` (space-separated `NAME=VALUE`), for trying a kernel's tuning
/// constants (those its file guards with `#ifndef`) on a GPU without a rebuild, and the switches set by
/// [`set_switch`]. The kernel cache keys on them.
fn tuning_defines() -> Vec<String> {
    let env = std::env::var_os("LILY_KERNEL_DEFINES").map(|v| v.to_string_lossy().into_owned());
    let env = env.unwrap_or_default();
    let switches = SWITCHES.lock().unwrap_or_else(|e| e.into_inner());
    merged_defines(&env, &switches)
}

/// The `-D` options of `env` (space-separated `NAME=VALUE`) less those of a name in `switches`, then the switches.
fn merged_defines(env: &str, switches: &[(String, String)]) -> Vec<String> {
    let switched = |d: &str| {
        let name = d.split('=').next().unwrap_or(d);
        switches.iter().any(|(n, _)| n == name)
    };
    let from_env = env.split_whitespace().filter(|d| !switched(d));
    from_env
        .map(|d| format!("-D{d}"))
        .chain(switches.iter().map(|(n, v)| format!("-D{n}={v}")))
        .collect()
}

/// The value `LILY_KERNEL_DEFINES` gives `name`, if it names it: for host plans that must agree with a kernel
/// constant before the kernels are compiled (the memory plan).
pub(crate) fn tuning_define(name: &str) -> Option<String> {
    tuning_defines().iter().find_map(|d| {
        d.strip_prefix("-D")?
            .strip_prefix(name)?
            .strip_prefix('=')
            .map(str::to_string)
    })
}

fn full_source(file_source: &str) -> String {
    format!("{COMMON}\n{file_source}")
}

/// Whether the NVRTC library can be loaded here.
pub fn nvrtc_available() -> bool {
    unsafe { nvrtc::is_culib_present() }
}

/// Compiles one file; returns the image (cubin or PTX with a NUL) and NVRTC's log.
pub fn compile(name: &str, source: &str, opts: &[String], machine_code: bool) -> Result<(Vec<u8>, String)> {
    if !nvrtc_available() {
        return Err(GpuError::Nvrtc("the NVRTC library (libnvrtc) was not found".into()));
    }
    let src = CString::new(full_source(source)).map_err(|e| GpuError::Nvrtc(e.to_string()))?;
    let cname = CString::new(name).map_err(|e| GpuError::Nvrtc(e.to_string()))?;
    let nv = |call: &str, r: nvrtc::nvrtcResult| {
        if r == nvrtc::nvrtcResult::NVRTC_SUCCESS {
            Ok(())
        } else {
            Err(GpuError::Nvrtc(format!("{call} on {name}: {r:?}")))
        }
    };
    unsafe {
        let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
        nv(
            "nvrtcCreateProgram",
            nvrtc::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
        )?;
        let copts: Vec<CString> = opts
            .iter()
            .map(|o| CString::new(o.as_str()).expect("options have no NUL"))
            .collect();
        let ptrs: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();
        let compiled = nvrtc::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr());
        let mut log_size = 0usize;
        let mut log = String::new();
        if nvrtc::nvrtcGetProgramLogSize(prog, &mut log_size) == nvrtc::nvrtcResult::NVRTC_SUCCESS && log_size > 1 {
            let mut buf = vec![0u8; log_size];
            if nvrtc::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char) == nvrtc::nvrtcResult::NVRTC_SUCCESS {
                log = String::from_utf8_lossy(&buf[..log_size - 1]).into_owned();
            }
        }
        if compiled != nvrtc::nvrtcResult::NVRTC_SUCCESS {
            nvrtc::nvrtcDestroyProgram(&mut prog);
            return Err(GpuError::Nvrtc(format!(
                "{name} does not compile ({compiled:?}):\n{log}"
            )));
        }
        let mut size = 0usize;
        let image = if machine_code {
            nv("nvrtcGetCUBINSize", nvrtc::nvrtcGetCUBINSize(prog, &mut size))?;
            let mut buf = vec![0u8; size];
            nv(
                "nvrtcGetCUBIN",
                nvrtc::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char),
            )?;
            buf
        } else {
            nv("nvrtcGetPTXSize", nvrtc::nvrtcGetPTXSize(prog, &mut size))?;
            let mut buf = vec![0u8; size];
            nv("nvrtcGetPTX", nvrtc::nvrtcGetPTX(prog, buf.as_mut_ptr() as *mut c_char))?;
            buf
        };
        nvrtc::nvrtcDestroyProgram(&mut prog);
        Ok((image, log))
    }
}

/// Compiles every kernel file for `arch` with `config`'s dimensions, without a GPU (the CI check): each file's name,
/// its image (machine code for an `sm_` arch, else PTX) and NVRTC's log.
pub fn compile_all(config: &Config, arch: &str, timeline: bool) -> Result<Vec<(String, Vec<u8>, String)>> {
    let target = Target { arch: arch.into() };
    let opts = options(config, &target, timeline);
    FILES
        .iter()
        .map(|file| {
            let (image, log) = compile(file.name, file.source, &opts, target.is_machine_code())?;
            Ok((file.name.to_string(), image, log))
        })
        .collect()
}

fn cache_path(name: &str, key: u64, target: &Target) -> PathBuf {
    let ext = if target.is_machine_code() { "cubin" } else { "ptx" };
    lily_model::default_model::cache_dir()
        .join("kernels")
        .join(format!("{name}-{}-{key:016x}.{ext}", target.arch))
}

fn hash_str(mut h: u64, s: &str) -> u64 {
    for chunk in s.as_bytes().chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = mix64(h ^ u64::from_le_bytes(word));
    }
    mix64(h ^ s.len() as u64)
}

/// The device address of a module's `__device__` variable `name`.
fn module_global(module: sys::CUmodule, name: &str) -> Result<u64> {
    let cname = CString::new(name).expect("variable names have no NUL");
    let (mut ptr, mut bytes) = (0u64, 0usize);
    check("cuModuleGetGlobal", unsafe {
        sys::cuModuleGetGlobal_v2(&mut ptr, &mut bytes, module, cname.as_ptr())
    })?;
    Ok(ptr)
}

/// Loaded kernels, by name, and the modules' integer constants and buffers.
pub struct Kernels {
    modules: Vec<sys::CUmodule>,
    functions: HashMap<&'static str, sys::CUfunction>,
    constants: HashMap<&'static str, i32>,
    buffers: HashMap<&'static str, u64>,
}

unsafe impl Send for Kernels {}

impl Kernels {
    /// Compiles (or takes from the disk cache) and loads every kernel for this GPU and model.
    pub fn load(gpu: &Gpu, config: &Config) -> Result<Kernels> {
        let target = Target::for_device(gpu.compute_capability);
        let opts = options(config, &target, TIMELINE.load(std::sync::atomic::Ordering::Relaxed));
        let mut kernels = Kernels {
            modules: Vec::new(),
            functions: HashMap::new(),
            constants: HashMap::new(),
            buffers: HashMap::new(),
        };
        for file in FILES {
            let (name, source) = (file.name, file.source);
            let key = hash_str(
                hash_str(hash_str(0x6c696c79, source), COMMON),
                &format!("{opts:?} {} {}", target.arch, gpu.driver_version),
            );
            let path = cache_path(name, key, &target);
            let image = match std::fs::read(&path) {
                Ok(bytes) => bytes,
                Err(_) => {
                    let (image, log) = compile(name, source, &opts, target.is_machine_code())?;
                    if !log.trim().is_empty() {
                        tracing::debug!("NVRTC on {name}:\n{log}");
                    }
                    store(&path, &image);
                    image
                }
            };
            let mut module: sys::CUmodule = std::ptr::null_mut();
            check("cuModuleLoadData", unsafe {
                sys::cuModuleLoadData(&mut module, image.as_ptr() as *const _)
            })?;
            kernels.modules.push(module);
            for sig in file.kernels {
                let f = sig.name;
                let cname = CString::new(f).expect("kernel names have no NUL");
                let mut func: sys::CUfunction = std::ptr::null_mut();
                check("cuModuleGetFunction", unsafe {
                    sys::cuModuleGetFunction(&mut func, module, cname.as_ptr())
                })?;
                // A launcher that passes other arguments than the compiled kernel takes stops the start-up here
                // (drivers before CUDA 12.4 cannot report parameters; there the CPU test's check has to do).
                if gpu.driver_version >= PARAM_INFO_DRIVER {
                    sig.check_layout(&param_layout(Kernel(func))?)
                        .map_err(GpuError::Other)?;
                }
                // Every kernel may take up to the device's limit of dynamic shared memory, less its static part.
                let mut static_bytes = 0i32;
                check("cuFuncGetAttribute", unsafe {
                    sys::cuFuncGetAttribute(
                        &mut static_bytes,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                        func,
                    )
                })?;
                let dynamic = gpu.max_shared_per_block.saturating_sub(static_bytes as usize) as i32;
                check("cuFuncSetAttribute", unsafe {
                    sys::cuFuncSetAttribute(
                        func,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        dynamic,
                    )
                })?;
                // Clusters of up to 16 blocks (the MoE gate/up launch shares the router's logits within one).
                if gpu.compute_capability.0 >= 9 {
                    check("cuFuncSetAttribute", unsafe {
                        sys::cuFuncSetAttribute(
                            func,
                            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                            1,
                        )
                    })?;
                }
                kernels.functions.insert(f, func);
            }
            for c in file.constants {
                let mut value = [0i32];
                gpu.download(DevPtr::from_raw(module_global(module, c)?), &mut value)?;
                kernels.constants.insert(c, value[0]);
            }
            for b in file.buffers {
                kernels.buffers.insert(b, module_global(module, b)?);
            }
        }
        Ok(kernels)
    }

    /// Points every module's `timeline` at `buf` (kernels compiled with the timeline only).
    pub fn attach_timeline(&self, gpu: &Gpu, buf: DevPtr<u64>) -> Result<()> {
        if !TIMELINE.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(GpuError::Other("the kernels were loaded without the timeline".into()));
        }
        for &module in &self.modules {
            let timeline = DevPtr::<u64>::from_raw(module_global(module, "timeline")?);
            gpu.upload(timeline, &[buf.raw()])?;
        }
        Ok(())
    }

    pub fn get(&self, name: &str) -> Kernel {
        Kernel(
            *self
                .functions
                .get(name)
                .unwrap_or_else(|| panic!("kernel {name} is not in FILES")),
        )
    }

    /// The parameter layout the driver reports for loaded kernel `name` (see [`param_layout`]).
    pub fn layout(&self, gpu: &Gpu, name: &str) -> Result<Vec<(usize, usize)>> {
        if gpu.driver_version < PARAM_INFO_DRIVER {
            return Err(GpuError::Other(format!(
                "driver {} cannot report kernel parameters (CUDA 12.4 can)",
                gpu.driver_version
            )));
        }
        param_layout(self.get(name))
    }

    /// The device address of a file's buffer (one of its `buffers`).
    pub fn buffer<T>(&self, name: &'static str) -> DevPtr<T> {
        DevPtr::from_raw(
            *self
                .buffers
                .get(name)
                .unwrap_or_else(|| panic!("buffer {name} is not in FILES")),
        )
    }

    pub fn constant(&self, name: &'static str) -> usize {
        *self
            .constants
            .get(name)
            .unwrap_or_else(|| panic!("constant {name} is not in FILES")) as usize
    }
}

#[cfg(test)]
impl Kernels {
    /// Kernels with no modules, only the given constants: for tests of what the host chooses from them.
    pub(crate) fn with_constants(constants: &[(&'static str, i32)]) -> Kernels {
        Kernels {
            modules: Vec::new(),
            functions: HashMap::new(),
            constants: constants.iter().copied().collect(),
            buffers: HashMap::new(),
        }
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        for m in &self.modules {
            let _ = unsafe { sys::cuModuleUnload(*m) };
        }
    }
}

/// The first driver version with `cuFuncGetParamInfo` (CUDA 12.4).
const PARAM_INFO_DRIVER: i32 = 12040;

/// The (offset, size) in bytes of each parameter of a compiled kernel, as the driver reports them. The driver
/// answers CUDA_ERROR_INVALID_VALUE for the first index past the last parameter (a kernel takes at most 4 KiB of
/// parameters, so at most 1024 of them).
fn param_layout(func: Kernel) -> Result<Vec<(usize, usize)>> {
    let mut layout = Vec::new();
    for i in 0..1024 {
        let (mut offset, mut size) = (0usize, 0usize);
        let status = unsafe { sys::cuFuncGetParamInfo(func.0, i, &mut offset, &mut size) };
        if status == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
            break;
        }
        check("cuFuncGetParamInfo", status)?;
        layout.push((offset, size));
    }
    Ok(layout)
}

/// Writes the cache file atomically; a cache that cannot be written only costs a recompile next time.
fn store(path: &PathBuf, image: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, image).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel file compiles for `arch` without a warning; false (with the reason printed) where libnvrtc
    /// cannot be loaded, the only case a test skips.
    fn compiles(config: &Config, arch: &str, timeline: bool) -> bool {
        if !nvrtc_available() {
            eprintln!("SKIPPED: libnvrtc not found (pip install nvidia-cuda-nvrtc==13.0.88 and put its nvidia/cu13/lib on LD_LIBRARY_PATH)");
            return false;
        }
        for (name, image, log) in compile_all(config, arch, timeline).unwrap_or_else(|e| panic!("{e}")) {
            assert!(!image.is_empty(), "{name}: empty image");
            if (Target { arch: arch.into() }).is_machine_code() {
                // What `lily selftest --compile-only --dump` writes for a disassembler: an ELF cubin.
                assert!(image.starts_with(b"\x7fELF"), "{name}: not an ELF image");
            }
            assert!(!log.contains("warning"), "{name}: {log}");
        }
        true
    }

    /// CI's check: every kernel compiles for sm_90a at both shapes with NVRTC, no GPU needed.
    #[test]
    fn every_kernel_compiles_for_sm_90a() {
        for config in [Config::full_shape(), Config::tiny_shape()] {
            if !compiles(&config, "sm_90a", false) {
                return;
            }
        }
    }

    /// The portable fallback: every kernel compiles to PTX for the oldest supported architecture (Ampere, whose
    /// bf16 and integer mma the kernels use), at the full shape.
    #[test]
    fn every_kernel_compiles_for_compute_80() {
        compiles(&Config::full_shape(), "compute_80", false);
    }

    /// Every kernel is launched as a programmatic dependent launch on Hopper (see `Gpu::launch`), which is
    /// safe only if it waits for its predecessor: each kernel's PTX entry holds `griddepcontrol.wait`.
    #[test]
    fn every_kernel_waits_for_its_predecessor() {
        if !nvrtc_available() {
            eprintln!("SKIPPED: libnvrtc not found");
            return;
        }
        let config = Config::tiny_shape();
        let opts = options(
            &config,
            &Target {
                arch: "compute_90".into(),
            },
            false,
        );
        for file in FILES {
            let (image, _) = compile(file.name, file.source, &opts, false).unwrap_or_else(|e| panic!("{e}"));
            let ptx = String::from_utf8_lossy(&image);
            for sig in file.kernels {
                let start = ptx
                    .find(&format!(".entry {}(", sig.name))
                    .unwrap_or_else(|| panic!("{}: no entry {} in the PTX", file.name, sig.name));
                let body = &ptx[start + 1..];
                let body = &body[..body.find(".entry ").unwrap_or(body.len())];
                assert!(
                    body.contains("griddepcontrol.wait"),
                    "{}: kernel {} never calls wait_previous()",
                    file.name,
                    sig.name
                );
            }
        }
    }

    /// Every constant the host reads by a literal name (a `constant` call anywhere in the crate's sources) is listed
    /// in a file of FILES, and every listed constant is defined in its file's source: an unlisted one would panic at
    /// its first read, on a GPU only.
    #[test]
    fn every_constant_the_host_reads_is_listed_and_defined() {
        let listed: Vec<&str> = FILES.iter().flat_map(|f| f.constants.iter().copied()).collect();
        for file in FILES {
            for name in file.constants {
                assert!(
                    file.source.contains(&format!(" {name} =")),
                    "{}: constant {name} is listed but not defined",
                    file.name
                );
            }
        }
        let mut dirs = vec![std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/src"))];
        let mut read = 0;
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                read += 1;
                for (at, _) in text.match_indices(".constant(\"") {
                    let rest = &text[at + ".constant(\"".len()..];
                    let name = &rest[..rest.find('"').unwrap()];
                    assert!(
                        listed.contains(&name),
                        "{}: constant {name} is not in FILES",
                        path.display()
                    );
                }
            }
        }
        assert!(read > 10, "only {read} source files found");
    }

    /// No kernel's warpgroup MMAs are serialized. ptxas serializes every `wgmma` of a kernel (waiting for each
    /// one as it is issued, its info C7514) when it finds an accumulator touched inside a pipeline stage, and
    /// inserts a wait of its own (info C7517) where it cannot prove that a product's registers are no longer in
    /// flight; the kernel still computes the right values, only without overlapping its products with other work.
    #[test]
    fn no_kernel_serializes_its_warpgroup_mmas() {
        if !nvrtc_available() {
            eprintln!("SKIPPED: libnvrtc not found");
            return;
        }
        let target = Target { arch: "sm_90a".into() };
        let mut opts = options(&Config::full_shape(), &target, false);
        opts.push("--ptxas-options=-v".into());
        let mut checked = 0;
        for file in FILES.iter().filter(|f| f.source.contains("wgmma.mma_async")) {
            let (_, log) = compile(file.name, file.source, &opts, true).unwrap_or_else(|e| panic!("{e}"));
            assert!(log.contains("Used"), "{}: ptxas wrote no report: {log}", file.name);
            let waits = added_waits(&log);
            assert!(waits.is_empty(), "{}: {}", file.name, waits.join("\n"));
            checked += 1;
        }
        assert!(checked >= 2, "only {checked} files use warpgroup MMAs");
        // The attention's build switches that the default build does not compile: its e4m3 values (ATTN_I8_V8,
        // with their scales fixed along a row), the same with a scale per key tile (ATTN_I8_V8_ROW=0), and O
        // rescaled every key tile (ATTN_LAZY=0).
        let file = FILES
            .iter()
            .find(|f| f.name == "attention_prefill.cu")
            .expect("the attention's file");
        for switch in ["ATTN_I8_V8=1", "ATTN_I8_V8=1 ATTN_I8_V8_ROW=0", "ATTN_LAZY=0"] {
            let mut opts = opts.clone();
            opts.extend(switch.split(' ').map(|d| format!("-D{d}")));
            let (_, log) = compile(file.name, file.source, &opts, true).unwrap_or_else(|e| panic!("{e}"));
            let waits = added_waits(&log);
            assert!(waits.is_empty(), "{switch}: {}", waits.join("\n"));
        }
    }

    /// The lines of ptxas's report `log` that say it serialized a kernel's warpgroup MMAs or added a wait for one.
    fn added_waits(log: &str) -> Vec<&str> {
        log.lines()
            .filter(|l| l.contains("C7514") || l.contains("C7517"))
            .collect()
    }

    #[test]
    fn a_switch_replaces_what_the_environment_says_for_its_name() {
        let switches = [("ATTN_I8_V8".to_string(), "1".to_string())];
        assert_eq!(
            merged_defines("GEMM_SMALL_MIN_PIECES=4 ATTN_I8_V8=0  ATTN_I8_V8_ROW=0", &switches),
            ["-DGEMM_SMALL_MIN_PIECES=4", "-DATTN_I8_V8_ROW=0", "-DATTN_I8_V8=1"]
        );
        assert_eq!(merged_defines("", &switches), ["-DATTN_I8_V8=1"]);
        assert_eq!(merged_defines(" A=1 ", &[]), ["-DA=1"]);
    }

    /// nvdisasm from `NVDISASM` or the PATH (scripts/python_env.sh puts the pip package's on it), if there is one.
    fn nvdisasm() -> Option<std::path::PathBuf> {
        if let Some(path) = std::env::var_os("NVDISASM") {
            return Some(path.into());
        }
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path)
            .map(|dir| dir.join("nvdisasm"))
            .find(|p| p.is_file())
    }

    /// In both warpgroup attention kernels the softmax of a key tile runs beside the previous tile's O += P V: in
    /// their machine code, the wait for that product (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) follows the tile's
    /// exponentials. Written as straight-line code, ptxas hoists that wait above the softmax (see apw_attention),
    /// and every other check still passes. Read from the disassembly: after the loop's first value product
    /// (`GMMA.64x256`), the wait must come after 32 `MUFU.EX2` and before the next product.
    #[test]
    fn attention_softmax_overlaps_the_value_product() {
        if !nvrtc_available() {
            eprintln!("SKIPPED: libnvrtc not found");
            return;
        }
        let Some(nvdisasm) = nvdisasm() else {
            eprintln!("SKIPPED: nvdisasm not found (pip install nvidia-cuda-nvdisasm, its nvidia/cu13/bin on PATH)");
            return;
        };
        let target = Target { arch: "sm_90a".into() };
        let opts = options(&Config::full_shape(), &target, false);
        let file = FILES
            .iter()
            .find(|f| f.name == "attention_prefill.cu")
            .expect("the attention file");
        let (image, _) = compile(file.name, file.source, &opts, true).unwrap_or_else(|e| panic!("{e}"));
        let cubin = std::env::temp_dir().join(format!("lily-attention-{}.cubin", std::process::id()));
        std::fs::write(&cubin, &image).expect("writing the cubin");
        let out = std::process::Command::new(&nvdisasm).arg("-c").arg(&cubin).output();
        let _ = std::fs::remove_file(&cubin);
        let out = out.unwrap_or_else(|e| panic!("running {}: {e}", nvdisasm.display()));
        assert!(
            out.status.success(),
            "nvdisasm: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let sass = String::from_utf8_lossy(&out.stdout);
        for kernel in ["attn_prefill_wgmma", "attn_prefill_i8"] {
            let start = sass
                .find(&format!(".text.{kernel}:"))
                .unwrap_or_else(|| panic!("{kernel} not found"));
            let body = &sass[start + 1..];
            let body = &body[..body.find(".text.").unwrap_or(body.len())];
            let code: Vec<&str> = body.lines().filter(|l| l.contains("/*")).collect();
            let first = code
                .iter()
                .position(|l| l.contains("GMMA.64x256"))
                .expect("a value product");
            let mut exponentials = 0;
            let mut overlapped = false;
            for line in &code[first + 1..] {
                if line.contains("MUFU.EX2") {
                    exponentials += 1;
                } else if exponentials >= 32 && line.contains("WARPGROUP.DEPBAR.LE gsb0, 0x0") {
                    overlapped = true;
                    break;
                } else if exponentials >= 32 && line.contains("GMMA") {
                    break;
                }
            }
            assert!(
                overlapped,
                "{kernel}: the wait for O += P V is not after the softmax's exponentials"
            );
        }
    }

    /// The kernels of `lily bench --timeline` (a clock probe after each kernel's wait) compile too.
    #[test]
    fn every_kernel_compiles_with_the_timeline() {
        compiles(&Config::full_shape(), "sm_90a", true);
    }
}
