//! Re-encodes a GGUF model's matrices in another block format, with kvattn's own quantizer
//! (`kvattn::decoder::blocks::quantize`), to compare the decoder's speed across formats:
//!
//! ```text
//! cargo run --release --features decoder --example requantize -- \
//!     --model SmolLM2-135M-Instruct.Q4_1.gguf --type q8_0 --out SmolLM2-135M.Q8_0.gguf
//! ```
//!
//! Every two-dimensional `*.weight` tensor but the token embedding is dequantized to f32 and
//! quantized to `--type`: `q8_0`, or `q4_k` (Q4_K where rows are a multiple of 256 values,
//! else Q5_0, as llama.cpp falls back for such rows). The token embedding, the norms and the
//! metadata are copied as they are. The values are the source file's (dequantized), so a
//! re-encoded Q4_1 model is that model's approximation in the new format, not a quantization of
//! the original weights.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};

use kvattn::decoder::blocks::dequantize;
use kvattn::decoder::blocks::quantize::quantize;
use kvattn::decoder::gguf::{GgmlType, GgufFile, Value};
use kvattn::decoder::gguf_writer::GgufWriter;
use kvattn::Result;

/// The target format.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum Target {
    /// Q8_0 for every matrix.
    #[value(name = "q8_0")]
    Q8_0,
    /// Q4_K where rows are a multiple of 256 values, else Q5_0.
    #[value(name = "q4_k")]
    Q4K,
}

#[derive(Parser, Debug)]
#[command(about = "Re-encodes a GGUF model's matrices in another block format")]
struct Args {
    /// The source GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// The target format.
    #[arg(long = "type", value_enum)]
    target: Target,
    /// The file to write.
    #[arg(long)]
    out: PathBuf,
}

/// The type a matrix with rows of `k` values becomes.
fn target_type(target: Target, k: u64) -> GgmlType {
    match target {
        Target::Q8_0 => GgmlType::Q8_0,
        Target::Q4K if k % 256 == 0 => GgmlType::Q4_K,
        Target::Q4K => GgmlType::Q5_0,
    }
}

fn run(args: &Args) -> Result<()> {
    let file = GgufFile::open(&args.model)?;
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata() {
        w.metadata(key, value.clone());
    }
    // llama.cpp's file types: MOSTLY_Q8_0 (7), MOSTLY_Q4_K_S (14).
    let file_type = match args.target {
        Target::Q8_0 => 7,
        Target::Q4K => 14,
    };
    w.metadata("general.file_type", Value::U32(file_type));
    let mut counts = std::collections::BTreeMap::new();
    for t in file.tensors() {
        let data = file.tensor_data(&t.name)?;
        let matrix =
            t.dims.len() == 2 && t.name.ends_with(".weight") && t.name != "token_embd.weight";
        let ty = if matrix {
            target_type(args.target, t.row_len())
        } else {
            t.ggml_type
        };
        let bytes = if ty == t.ggml_type {
            data.to_vec()
        } else {
            let values = dequantize(t.ggml_type, data, t.n_elements as usize)?;
            quantize(ty, &values)?
        };
        *counts.entry(ty.name()).or_insert(0) += 1;
        w.tensor(&t.name, ty, &t.dims, bytes)?;
    }
    w.write_file(&args.out)?;
    let size = std::fs::metadata(&args.out).map(|m| m.len()).unwrap_or(0);
    let types: Vec<String> = counts.iter().map(|(t, n)| format!("{n} {t}")).collect();
    println!(
        "{}: {} tensors ({}), {:.1} MB",
        args.out.display(),
        file.tensors().len(),
        types.join(", "),
        size as f64 / 1e6
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
