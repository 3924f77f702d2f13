//! The `kvattn` command line: `info`, `capacity`, `run` (one kernel on a safetensors case file),
//! `verify` (every kernel against the CPU reference; `--quality`, the quality table of the
//! KV storage formats) and `serve-bench` (the scheduler under load, swept over concurrency).

mod capacity;
mod case;
mod info;
mod plot;
mod quality;
mod run;
mod run_mla;
mod serve_bench;
mod verify;

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
    /// Run one kernel on tensors from a safetensors case file and write the result.
    Run(run::RunArgs),
    /// Check every kernel and storage format this adapter supports against the CPU reference.
    Verify(verify::VerifyArgs),
    /// Serve a synthetic workload with the continuous-batching scheduler at each concurrency:
    /// throughput, time to first token, inter-token latency, preemptions.
    ServeBench(Box<serve_bench::ServeBenchArgs>),
}

fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // serve-bench's usage errors are one line like its other errors.
        Err(e) if serve_bench::is_usage_error(&e) => {
            eprintln!("kvattn: serve-bench: {}", serve_bench::usage_line(&e));
            return std::process::ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    let result = match cli.command {
        Command::Info(args) => info::run(&args),
        Command::Capacity(args) => capacity::run(&args),
        Command::Run(args) => run::run(&args),
        Command::ServeBench(args) => serve_bench::run(&args),
        Command::Verify(args) => match verify::run(&args) {
            // verify has printed its table and which checks failed.
            Ok(false) => return std::process::ExitCode::FAILURE,
            other => other.map(|_| ()),
        },
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line, whatever the message holds (driver and validator messages have
            // newlines).
            let msg = e.to_string();
            let line: Vec<&str> = msg.split_whitespace().collect();
            eprintln!("kvattn: {}", line.join(" "));
            std::process::ExitCode::FAILURE
        }
    }
}
