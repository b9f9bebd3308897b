//! The default model: the trained tiny model kept compressed in the repository's `models/` folder, unpacked into
//! a cache directory on first use, so a fresh checkout generates real text with no download.

use std::path::{Path, PathBuf};

pub const NAME: &str = "lily-tiny-shakespeare";
/// Files kept zstd-compressed in the repository (unpacked without the `.zst`), and files kept as they are.
const COMPRESSED: [&str; 2] = ["model.safetensors", "tokenizer.json"];
const PLAIN: [&str; 4] = [
    "config.json",
    "generation_config.json",
    "chat_template.jinja",
    "README.md",
];

#[derive(Debug, thiserror::Error)]
pub enum DefaultModelError {
    #[error(
        "no model given and the default model ({NAME}) was not found: run lily from its checkout, \
         or pass --model DIR (or set LILY_MODEL)"
    )]
    NotFound,
    #[error("unpacking the default model into {path}: {source}")]
    Unpack { path: PathBuf, source: std::io::Error },
}

/// The packed default model: `models/lily-tiny-shakespeare` in the checkout the binary was built from or runs
/// from (found from the executable's and the working directory's ancestors).
pub fn packed_dir() -> Option<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).map(Path::to_path_buf));
    }
    if let Ok(cwd) = std::env::current_dir() {
        roots.extend(cwd.ancestors().map(Path::to_path_buf));
    }
    roots.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")));
    roots
        .into_iter()
        .map(|root| root.join("models").join(NAME))
        .find(|dir| dir.join("model.safetensors.zst").is_file())
}

/// The cache directory: `$LILY_CACHE`, else `$XDG_CACHE_HOME/lily`, else `~/.cache/lily`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("LILY_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("lily");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("lily")
}

/// The unpacked default model directory, unpacking it first if needed.
pub fn locate() -> Result<PathBuf, DefaultModelError> {
    let packed = packed_dir().ok_or(DefaultModelError::NotFound)?;
    let target = cache_dir().join(format!("{NAME}-{:016x}", fingerprint(&packed)));
    if target.join("model.safetensors").is_file() {
        return Ok(target);
    }
    unpack(&packed, &target).map_err(|source| DefaultModelError::Unpack {
        path: target.clone(),
        source,
    })?;
    Ok(target)
}

/// Changes when any packed file changes size or content at its start (enough to tell versions apart).
fn fingerprint(packed: &Path) -> u64 {
    let mut h = 0u64;
    for name in COMPRESSED
        .iter()
        .map(|n| format!("{n}.zst"))
        .chain(PLAIN.iter().map(|n| n.to_string()))
    {
        let path = packed.join(&name);
        let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        h = crate::rng::mix64(h ^ len);
        if let Ok(bytes) = std::fs::read(&path) {
            for chunk in bytes.chunks(8).take(4096) {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                h = crate::rng::mix64(h ^ u64::from_le_bytes(word));
            }
        }
    }
    h
}

/// Unpacks into a temporary sibling directory, then renames it into place, so a partial unpack is never used.
fn unpack(packed: &Path, target: &Path) -> std::io::Result<()> {
    let parent = target.parent().expect("cache path has a parent");
    std::fs::create_dir_all(parent)?;
    let tmp = parent.join(format!(".unpack-{}-{}", NAME, std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let result = (|| {
        for name in COMPRESSED {
            let mut input = std::fs::File::open(packed.join(format!("{name}.zst")))?;
            let mut output = std::fs::File::create(tmp.join(name))?;
            zstd::stream::copy_decode(&mut input, &mut output)?;
            output.sync_all()?;
        }
        for name in PLAIN {
            std::fs::copy(packed.join(name), tmp.join(name))?;
        }
        match std::fs::rename(&tmp, target) {
            // Another process unpacked it first.
            Err(_) if target.join("model.safetensors").is_file() => Ok(()),
            other => other,
        }
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    result
}
