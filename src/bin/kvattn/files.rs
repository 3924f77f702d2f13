//! Output files of the sweeps (`serve-bench`, `bench`): checked before the run, written all
//! or none after it.

use std::path::{Path, PathBuf};

use kvattn::Result;

use crate::case::invalid;

/// Checks that `path` can be written later (its directory exists), before the sweep runs.
pub fn check_writable(flag: &str, path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(invalid(format!(
            "{flag} {}: the directory {} does not exist",
            path.display(),
            dir.display()
        )));
    }
    if path.is_dir() {
        return Err(invalid(format!("{flag} {} is a directory", path.display())));
    }
    Ok(())
}

/// Writes every `(path, text)` or none: each goes to a temporary file beside its path first,
/// and the temporaries are renamed only once all are written.
pub fn write_all_or_none(files: &[(&Path, String)]) -> Result<()> {
    let temp = |p: &Path| {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "out".into());
        p.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
    };
    let temps: Vec<PathBuf> = files.iter().map(|(p, _)| temp(p)).collect();
    let cleanup = |temps: &[PathBuf]| {
        for t in temps {
            let _ = std::fs::remove_file(t);
        }
    };
    for ((path, text), tmp) in files.iter().zip(&temps) {
        if let Err(e) = std::fs::write(tmp, text) {
            cleanup(&temps);
            return Err(invalid(format!("cannot write {}: {e}", path.display())));
        }
    }
    for (i, ((path, _), tmp)) in files.iter().zip(&temps).enumerate() {
        if let Err(e) = std::fs::rename(tmp, path) {
            cleanup(&temps);
            for (done, _) in &files[..i] {
                let _ = std::fs::remove_file(done);
            }
            return Err(invalid(format!("cannot write {}: {e}", path.display())));
        }
    }
    Ok(())
}
