//! `pw-bench`: the GPU benchmarks of PagedWeight (kernels, decode step, page table, raisings,
//! serving) and the SASS tool, one binary carried to the GPU machine. Each writes JSON records
//! that `benches/results/` curates.

mod attention;
mod decode;
mod dense;
mod grouped;
mod kernels;
mod pages;
#[cfg(feature = "cuda")]
mod prefill;
mod raise;
#[cfg(feature = "cuda")]
mod sass_gemv;
mod serve;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Directory of the shipped model (relative to the repository root, where the benchmarks run).
const DEFAULT_MODEL: &str = "assets/tiny-mixtral";

#[derive(Parser)]
#[command(name = "pw-bench", version, about = "GPU benchmarks of PagedWeight")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Keep the CUDA kernels this process compiles in this build's directory under DIR, and
    /// load those an earlier process kept there (default: compile every kernel in every process).
    #[arg(long, global = true)]
    kernel_cache: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// GPU benchmark of the bit-plane kernels on the expert shapes of Mixtral,
    /// Qwen1.5-MoE and Gemma-4 (single blocks at 1..16 tokens and whole
    /// grouped layers, bits 3..8), against the streaming read bandwidth
    /// measured in the same run. Writes JSON records to --out.
    #[command(name = "bench-kernels")]
    Kernels(kernels::BenchKernelsArgs),
    /// GPU benchmark of the fused decode step (pw-decode) of a Mixtral-8x7B-shaped model with
    /// synthetic weights at several batch sizes, against bytes read / measured bandwidth.
    #[command(name = "bench-decode")]
    Decode(decode::BenchDecodeArgs),
    /// GPU benchmark of the weight page table: host→GPU reload bandwidth through the mover vs a
    /// plain pinned copy, and a Mixtral-8x7B-shaped decode step's expert work with and without
    /// pages reloading in the background (JSON to --out).
    #[command(name = "bench-pages")]
    Pages(pages::BenchPagesArgs),
    /// GPU check and benchmark of page raisings in the fast decode path: a model raised 3 → 8
    /// bits through the decoder's mover equals one loaded at 8 bits (greedy tokens, logits),
    /// and a full-size shape keeps decoding while its pages are raised (GB/s, step times).
    #[command(name = "bench-raise")]
    Raise(raise::BenchRaiseArgs),
    /// GPU benchmark of serving: a stream of requests at a fixed arrival rate through the
    /// engine over a synthetic full-size model under a fixed memory limit, experts pinned at
    /// 8 bits vs the planner free to lower them. Writes JSON records to --out.
    #[command(name = "bench-serve")]
    Serve(serve::BenchServeArgs),
    /// Writes the CUDA C++ of the routed expert GEMV launches of the three models as the CUDA
    /// runtime compiles them on the H200, without a GPU (`scripts/sass_gemv.sh` reads their
    /// registers and instructions per weight off `sm_90a` SASS).
    #[cfg(feature = "cuda")]
    SassGemv(sass_gemv::SassGemvArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(root) = &cli.kernel_cache {
        keep_compiled_kernels(root)?;
    }
    match cli.command {
        Command::Kernels(args) => kernels::bench_kernels(&args),
        Command::Decode(args) => decode::bench_decode(&args),
        Command::Pages(args) => pages::bench_pages(&args),
        Command::Raise(args) => raise::bench_raise(&args),
        Command::Serve(args) => serve::bench_serve(&args),
        #[cfg(feature = "cuda")]
        Command::SassGemv(args) => sass_gemv::sass_gemv(&args),
    }
}

#[cfg(feature = "cuda")]
fn keep_compiled_kernels(root: &std::path::Path) -> Result<()> {
    let dir = kernels_cubecl::kernel_cache::persist_cuda_kernels(root)?;
    eprintln!("compiled CUDA kernels kept in {}", dir.display());
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn keep_compiled_kernels(_root: &std::path::Path) -> Result<()> {
    anyhow::bail!("--kernel-cache: this binary was built without CUDA; rebuild with `--features cuda`")
}
