//! A persistent cache of the PTX that CubeCL's CUDA runtime compiles, so that a server's next
//! start (or a benchmark's next process) loads its kernels instead of compiling each of them again
//! with NVRTC.
//!
//! CubeCL keys cached PTX by a kernel's name and comptime arguments, not by its code, and the PTX
//! targets one GPU architecture: a cache shared by two builds, or by two GPU models, could hand
//! out stale or foreign PTX. So every build of the executable on every GPU model gets a directory
//! of its own under the root ([`cuda_cache_dir`]).

use std::hash::Hasher;
use std::io::Read;
use std::path::{Path, PathBuf};

use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// Why the kernel cache could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum KernelCacheError {
    /// CubeCL read its configuration (a client exists) before the cache was set.
    #[error(
        "CubeCL's configuration was already read: the kernel cache must be set before the first GPU client"
    )]
    AlreadyConfigured,
    /// The executable could not be read to tell this build from others.
    #[error("reading the executable {path} to key the kernel cache: {source}")]
    Executable {
        /// The executable's path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The cache directory could not be created.
    #[error("creating the kernel cache directory {path}: {source}")]
    Directory {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The CUDA driver could not name the GPU.
    #[cfg(feature = "cuda")]
    #[error("asking the CUDA driver for GPU 0: {0}")]
    Driver(String),
}

/// The directory under `root` for this executable on a GPU called `gpu` (any text naming the
/// model and architecture; it is reduced to `[a-z0-9-]`).
pub fn cache_dir_for_build(root: &Path, gpu: &str) -> Result<PathBuf, KernelCacheError> {
    let exe = std::env::current_exe().map_err(|source| KernelCacheError::Executable {
        path: PathBuf::from("(current executable)"),
        source,
    })?;
    let build =
        file_hash(&exe).map_err(|source| KernelCacheError::Executable { path: exe.clone(), source })?;
    let mut tag: String =
        gpu.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    while tag.contains("--") {
        tag = tag.replace("--", "-");
    }
    Ok(root.join(format!("{}-{build:016x}", tag.trim_matches('-'))))
}

/// A hash of a file's bytes, stable for the same bytes read by the same executable.
fn file_hash(path: &Path) -> std::io::Result<u64> {
    let mut file = std::fs::File::open(path)?;
    // `DefaultHasher::new` has fixed keys: the same bytes hash the same in every run of a build.
    let mut hasher = std::hash::DefaultHasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(hasher.finish());
        }
        hasher.write(&buf[..n]);
    }
}

/// Makes CubeCL keep the PTX it compiles in `dir` (created if missing), keeping every other
/// setting of a `cubecl.toml` above the working directory. A cache location set there wins.
/// Must run before the first GPU client is created. Returns the directory in use.
pub fn persist_compiled_kernels(dir: &Path) -> Result<PathBuf, KernelCacheError> {
    if CubeClRuntimeConfig::storage().lock().is_some() {
        return Err(KernelCacheError::AlreadyConfigured);
    }
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if let Some(existing) = &config.compilation.cache {
        let root = existing.root();
        CubeClRuntimeConfig::set(config);
        return Ok(root);
    }
    std::fs::create_dir_all(dir)
        .map_err(|source| KernelCacheError::Directory { path: dir.to_path_buf(), source })?;
    config.compilation.cache = Some(cubecl::config::cache::CacheConfig::File(dir.to_path_buf()));
    CubeClRuntimeConfig::set(config);
    Ok(dir.to_path_buf())
}

/// [`persist_compiled_kernels`] in this build's directory under `root` for CUDA GPU 0, named by
/// the driver (model and compute capability).
#[cfg(feature = "cuda")]
pub fn persist_cuda_kernels(root: &Path) -> Result<PathBuf, KernelCacheError> {
    use cudarc::driver::{result, sys};
    let driver = |e: result::DriverError| KernelCacheError::Driver(e.to_string());
    // SAFETY: only tries to open the driver library; without it every other call would panic.
    if !unsafe { sys::is_culib_present() } {
        return Err(KernelCacheError::Driver("no CUDA driver library on this machine".into()));
    }
    result::init().map_err(driver)?;
    let dev = result::device::get(0).map_err(driver)?;
    let name = result::device::get_name(dev).map_err(driver)?;
    // SAFETY: `dev` is a device the driver just returned.
    let (major, minor) = unsafe {
        (
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )
            .map_err(driver)?,
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )
            .map_err(driver)?,
        )
    };
    persist_compiled_kernels(&cache_dir_for_build(root, &format!("{name} sm{major}{minor}"))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_and_gpus_get_directories_of_their_own() {
        let root = Path::new("/cache");
        let a = cache_dir_for_build(root, "NVIDIA H200 sm90").unwrap();
        let b = cache_dir_for_build(root, "NVIDIA H100 80GB HBM3 sm90").unwrap();
        assert_ne!(a, b);
        assert_eq!(a, cache_dir_for_build(root, "NVIDIA H200 sm90").unwrap());
        let name = a.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("nvidia-h200-sm90-"), "{name}");
        assert_eq!(a.parent(), Some(root));
    }

    #[test]
    fn the_build_key_follows_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (x, y) = (dir.path().join("x"), dir.path().join("y"));
        std::fs::write(&x, vec![7u8; 3 << 20]).unwrap();
        let mut other = vec![7u8; 3 << 20];
        other[(3 << 20) - 1] = 8;
        std::fs::write(&y, &other).unwrap();
        assert_eq!(file_hash(&x).unwrap(), file_hash(&x).unwrap());
        assert_ne!(file_hash(&x).unwrap(), file_hash(&y).unwrap());
    }
}
