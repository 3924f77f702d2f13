//! Every buffer, bind group, pipeline, upload and submission of the crate goes through one
//! counting method of `Context` (src/gpu/), so `Context::counters` is exact: no module outside
//! the GPU layer calls the device or queue for them directly.

use std::path::Path;

/// Calls that create, upload or submit, which only `src/gpu/` and the pipeline cache may make.
const DOORS: [&str; 7] = [
    "device.create_buffer(",
    ".create_bind_group(",
    "queue.submit(",
    "queue.write_buffer(",
    ".create_compute_pipeline(",
    ".create_command_encoder(",
    ".create_query_set(",
];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn only_the_gpu_layer_creates_uploads_or_submits() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    assert!(files.len() > 50, "found only {} source files", files.len());
    let allowed = [root.join("src/gpu"), root.join("src/pipeline.rs")];
    let mut stray = Vec::new();
    let mut seen_in_gpu = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let inside = allowed.iter().any(|a| file.starts_with(a));
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for door in DOORS {
                if code.contains(door) {
                    if inside {
                        seen_in_gpu += 1;
                    } else {
                        stray.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                    }
                }
            }
        }
    }
    // The doors exist where they should (the scan would otherwise pass for the wrong reason).
    assert!(seen_in_gpu >= 6, "only {seen_in_gpu} door calls in src/gpu");
    assert!(
        stray.is_empty(),
        "calls that bypass the counters:\n{}",
        stray.join("\n")
    );
}
