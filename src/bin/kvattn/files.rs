//! Output files of every command that writes files (`run`, `bench`, `serve-bench`): checked
//! before any GPU work ([`check_outputs`]), and the sweeps' files written all or none after the
//! run ([`write_all_or_none`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvattn::{Error, Result};

use crate::case::invalid;

/// Checks a command's output files before it does any work: each `(flag, path)` of `outputs`
/// names a file (not a directory) in a directory that exists and can be written, and no two
/// of them, nor an output and one of the `inputs`, are the same file. Paths are compared
/// canonically (symlinks resolved, `./x` and `x` alike); an output that does not exist yet is
/// its canonical directory and its file name. An input that cannot be resolved is skipped
/// here: reading it reports it.
pub fn check_outputs(outputs: &[(&str, &Path)], inputs: &[(&str, &Path)]) -> Result<()> {
    let mut seen: Vec<(&str, &Path, PathBuf)> = inputs
        .iter()
        .filter_map(|&(flag, path)| identity(path).ok().map(|id| (flag, path, id)))
        .collect();
    for &(flag, path) in outputs {
        check_writable(flag, path)?;
        let id = identity(path).map_err(|source| Error::Io {
            what: format!("{flag} {}: cannot resolve it", path.display()),
            source,
        })?;
        if let Some((other, other_path, _)) = seen.iter().find(|s| s.2 == id) {
            return Err(invalid(format!(
                "{flag} {} is the same file as {other} {}; give {flag} a path of its own",
                path.display(),
                other_path.display()
            )));
        }
        seen.push((flag, path, id));
    }
    Ok(())
}

/// The directory `path` is in (`.` for a bare file name).
fn dir_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// The canonical name of `path`: the file's own when it exists, else its canonical directory
/// joined with its file name.
fn identity(path: &Path) -> std::io::Result<PathBuf> {
    if let Ok(p) = std::fs::canonicalize(path) {
        return Ok(p);
    }
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "it names no file"))?;
    Ok(std::fs::canonicalize(dir_of(path))?.join(name))
}

/// Checks that `path` can be written later: it names a file, not a directory, and its
/// directory exists and takes a new file (a probe file is created there and removed).
fn check_writable(flag: &str, path: &Path) -> Result<()> {
    static PROBES: AtomicUsize = AtomicUsize::new(0);
    let dir = dir_of(path);
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
    if path.file_name().is_none() {
        return Err(invalid(format!("{flag} {} names no file", path.display())));
    }
    let probe = dir.join(format!(
        ".kvattn-probe-{}-{}",
        std::process::id(),
        PROBES.fetch_add(1, Ordering::Relaxed)
    ));
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe);
    match created {
        Ok(file) => {
            drop(file);
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(source) => Err(Error::Io {
            what: format!(
                "{flag} {}: cannot write in the directory {}",
                path.display(),
                dir.display()
            ),
            source,
        }),
    }
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
        if let Err(source) = std::fs::write(tmp, text) {
            cleanup(&temps);
            return Err(cannot_write(path, source));
        }
    }
    for (i, ((path, _), tmp)) in files.iter().zip(&temps).enumerate() {
        if let Err(source) = std::fs::rename(tmp, path) {
            cleanup(&temps);
            for (done, _) in &files[..i] {
                let _ = std::fs::remove_file(done);
            }
            return Err(cannot_write(path, source));
        }
    }
    Ok(())
}

/// "cannot write PATH: why", the I/O error kept as the source.
fn cannot_write(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        what: format!("cannot write {}", path.display()),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for one test.
    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvattn-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_same_file_under_two_spellings_is_refused() {
        let dir = temp_dir("same");
        let input = dir.join("in.safetensors");
        std::fs::write(&input, b"x").unwrap();
        let dotted = dir.join(".").join("in.safetensors");
        let err = check_outputs(&[("--out", &dotted)], &[("--in", &input)]).unwrap_err();
        assert!(err.to_string().contains("same file as --in"), "{err}");
        let a = dir.join("a.csv");
        let b = dir.join("sub").join("..").join("a.csv");
        std::fs::create_dir(dir.join("sub")).unwrap();
        let err = check_outputs(&[("--csv", &a), ("--svg", &b)], &[]).unwrap_err();
        assert!(err.to_string().contains("--svg"), "{err}");
        assert!(check_outputs(&[("--csv", &a), ("--svg", &dir.join("a.svg"))], &[]).is_ok());
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "probe files left: {names:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
