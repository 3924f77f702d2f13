//! The `kvattn` command line: `info`, `capacity`, `run` (one kernel on a safetensors case file),
//! `verify` (every kernel against the CPU reference; `--quality`, the quality table of the
//! KV storage formats), `serve-bench` (the scheduler under load, swept over concurrency) and
//! `bench` (the kernels against the adapter's ceilings).

mod bench;
mod capacity;
mod case;
mod files;
mod info;
mod output;
mod quality;
mod run;
mod run_mla;
mod serve_bench;
mod usage;
mod verify;

use clap::{CommandFactory, Parser, Subcommand};

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
    /// Time the kernels (decode, prefill, append, MLA, copy) beside the adapter's copy bandwidth
    /// and FMA rate measured in the same run: GB/s, GFLOP/s and the fraction of the roofline.
    Bench(Box<bench::BenchArgs>),
}

fn main() -> std::process::ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        // Usage errors are one line like every other error (clap's exit status, 2); help and
        // version print in full.
        Err(e) => match usage::one_line(&e, &Cli::command(), &args) {
            Some(line) => {
                eprintln!("kvattn: {line}");
                return std::process::ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
            }
            None => e.exit(),
        },
    };
    let result = match cli.command {
        Command::Info(args) => info::run(&args),
        Command::Capacity(args) => capacity::run(&args),
        Command::Run(args) => run::run(&args),
        Command::ServeBench(args) => serve_bench::run(&args),
        Command::Bench(args) => bench::run(&args),
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
