//! The `kvattn` command line: `kvattn info` (more subcommands come with later issues).

mod capacity;
mod info;

use clap::{Parser, Subcommand};

/// Cross-vendor GPU attention kernels over a KV cache.
#[derive(Parser)]
#[command(name = "kvattn", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the adapter, its features and the limits that matter to kvattn.
    Info(info::InfoArgs),
    /// KV cache bytes per token and for a batch, and how many tokens or sequences fit a budget.
    Capacity(Box<capacity::CapacityArgs>),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info(args) => info::run(&args),
        Command::Capacity(args) => capacity::run(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvattn: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
