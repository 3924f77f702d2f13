//! The repository's references to its design document hold: no file points to a design outside
//! the repository, every "ARCHITECTURE.md section N" a comment or doc cites is a numbered
//! section of `docs/ARCHITECTURE.md`, and every link to one of its headings (`#6-kv-...`) names
//! a heading that exists. Sections are renumbered by editing that page; this test then names
//! every citation left behind.

use std::path::{Path, PathBuf};

/// Folders whose text files may cite the design, and the file types read there.
const DIRS: [&str; 7] = [
    "src", "shaders", "tests", "benches", "examples", "docs", ".ci",
];
const EXTENSIONS: [&str; 4] = ["rs", "wgsl", "md", "toml"];

fn text_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            text_files(&path, out);
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| EXTENSIONS.contains(&e))
            || dir.file_name().is_some_and(|n| n == ".ci")
        {
            out.push(path);
        }
    }
}

/// The files to check: every text file of [`DIRS`], the README and Cargo.toml, but this test
/// (whose own strings spell what it looks for).
fn repository_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md"), root.join("Cargo.toml")];
    for dir in DIRS {
        text_files(&root.join(dir), &mut files);
    }
    let me = root.join(file!());
    files.retain(|f| *f != me);
    files
}

/// The numbered sections of `docs/ARCHITECTURE.md` (`## N. Title`): (number, GitHub anchor).
fn sections() -> Vec<(u32, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let page = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    page.lines()
        .filter_map(|line| {
            let title = line.strip_prefix("## ")?;
            let (number, _) = title.split_once(". ")?;
            Some((number.parse().ok()?, anchor(title)))
        })
        .collect()
}

/// GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to hyphens.
fn anchor(title: &str) -> String {
    title
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// A file's text with comment markers removed and lines joined, so that a citation broken over
/// two comment lines ("ARCHITECTURE.md\n//! section 6") reads as one.
fn joined(text: &str) -> String {
    text.lines()
        .map(|line| {
            let line = line.trim_start();
            ["//!", "///", "//", "#"]
                .iter()
                .find_map(|m| line.strip_prefix(m))
                .unwrap_or(line)
                .trim()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The section numbers cited after each "ARCHITECTURE.md section(s)": "section 6", "sections
/// 6 and 7", "sections 9, 12 and 15".
fn cited_sections(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("ARCHITECTURE.md section") {
        rest = &rest[at + "ARCHITECTURE.md section".len()..];
        let list = rest.strip_prefix('s').unwrap_or(rest);
        let mut words = list.split_whitespace();
        while let Some(word) = words.next() {
            let digits: String = word.chars().take_while(|c| c.is_ascii_digit()).collect();
            let Ok(n) = digits.parse() else { break };
            out.push(n);
            // A list goes on after "6," or "6 and".
            if word.ends_with(',') {
                continue;
            }
            if word != digits || words.next() != Some("and") {
                break;
            }
        }
    }
    out
}

#[test]
fn no_reference_to_a_design_outside_the_repository() {
    let files = repository_files();
    assert!(files.len() > 80, "found only {} files", files.len());
    let stray: Vec<String> = files
        .iter()
        .filter(|f| {
            std::fs::read_to_string(f)
                .map(|t| t.contains("DESIGN.md"))
                .unwrap_or(false)
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        stray.is_empty(),
        "these files cite DESIGN.md, which is not in the repository (docs/ARCHITECTURE.md is \
         the design): {stray:#?}"
    );
}

/// The anchors linked after each "ARCHITECTURE.md#", up to a `)` or white space.
fn linked_anchors(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("ARCHITECTURE.md#") {
        rest = &rest[at + "ARCHITECTURE.md#".len()..];
        let end = rest
            .find(|c: char| c == ')' || c.is_whitespace())
            .unwrap_or(rest.len());
        out.push(&rest[..end]);
    }
    out
}

/// Runs `refs` over the text of every repository file; `refs` names each reference it finds
/// and says whether it resolves. Returns how many were found and "file: name" for each that
/// does not resolve.
fn unresolved(refs: impl Fn(&str) -> Vec<(String, bool)>) -> (usize, Vec<String>) {
    let (mut found, mut missing) = (0, Vec::new());
    for file in repository_files() {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        for (name, resolves) in refs(&text) {
            found += 1;
            if !resolves {
                missing.push(format!("{}: {name}", file.display()));
            }
        }
    }
    (found, missing)
}

#[test]
fn every_cited_section_exists() {
    let sections = sections();
    assert!(
        sections.len() >= 10,
        "found only {} sections",
        sections.len()
    );
    let (cited, missing) = unresolved(|text| {
        cited_sections(&joined(text))
            .into_iter()
            .map(|n| {
                (
                    format!("section {n}"),
                    sections.iter().any(|(s, _)| *s == n),
                )
            })
            .collect()
    });
    assert!(cited > 20, "found only {cited} citations");
    assert!(
        missing.is_empty(),
        "cited sections that do not exist: {missing:#?}"
    );
}

#[test]
fn every_link_to_a_heading_exists() {
    let sections = sections();
    let (links, missing) = unresolved(|text| {
        linked_anchors(text)
            .into_iter()
            .map(|a| (format!("#{a}"), sections.iter().any(|(_, s)| s == a)))
            .collect()
    });
    assert!(links > 0, "found no links to a heading");
    assert!(
        missing.is_empty(),
        "links to headings that do not exist: {missing:#?}"
    );
}

#[test]
fn citations_are_parsed_as_written() {
    assert_eq!(cited_sections("ARCHITECTURE.md section 6 says"), [6]);
    assert_eq!(
        cited_sections("(ARCHITECTURE.md sections 6 and 7), bit"),
        [6, 7]
    );
    assert_eq!(
        cited_sections("ARCHITECTURE.md sections 9, 12 and 15."),
        [9, 12, 15]
    );
    assert_eq!(cited_sections("ARCHITECTURE.md section 13)."), [13]);
    assert_eq!(
        cited_sections("ARCHITECTURE.md, \"Tolerances\""),
        Vec::<u32>::new()
    );
    assert_eq!(
        joined("//! a (ARCHITECTURE.md\n//! section 12). b"),
        "a (ARCHITECTURE.md section 12). b"
    );
    assert_eq!(
        linked_anchors(
            "[a](docs/ARCHITECTURE.md#6-kv-storage-formats) and\nARCHITECTURE.md#1-principles"
        ),
        ["6-kv-storage-formats", "1-principles"]
    );
    assert_eq!(
        anchor("10. NaN, infinities and extreme values"),
        "10-nan-infinities-and-extreme-values"
    );
}
