//! The kernel cache sets CubeCL's process-wide configuration, so it is tested in a binary of
//! its own.

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use kernels_cubecl::kernel_cache::{KernelCacheError, persist_compiled_kernels};

#[test]
fn the_cache_directory_becomes_cubecls_and_is_set_only_before_the_first_client() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("kernels").join("build");
    let used = persist_compiled_kernels(&cache).unwrap();
    assert_eq!(used, cache);
    assert!(cache.is_dir(), "the directory is created");
    match &CubeClRuntimeConfig::get().compilation.cache {
        Some(CacheConfig::File(p)) => assert_eq!(p, &cache),
        other => panic!("CubeCL's cache is {other:?}"),
    }
    // Once CubeCL has its configuration, a second setting is refused, not a panic.
    assert!(matches!(persist_compiled_kernels(dir.path()), Err(KernelCacheError::AlreadyConfigured)));
}
