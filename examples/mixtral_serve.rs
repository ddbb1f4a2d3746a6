//! The OpenAI-compatible server: `cargo run --release --example mixtral_serve [-- OPTIONS]`.
//!
//! With no options it serves the shipped model (`assets/tiny-mixtral`) on 127.0.0.1:8000 on the
//! best backend of the build and prints the URL and a curl line to try. Same options as
//! `pagedweight serve` (`--help` lists them); `--once "prompt"` prints one completion and exits.

use clap::Parser;

#[derive(Parser)]
#[command(name = "mixtral_serve", about = "Serve a MoE model over an OpenAI-compatible HTTP API")]
struct Cli {
    #[command(flatten)]
    args: pagedweight::serve_cmd::ServeArgs,
}

fn main() -> anyhow::Result<()> {
    pagedweight::serve_cmd::serve_command(&Cli::parse().args)
}
