//! `shaders/lib/ggml_blocks.wgsl` written out for one ggml type: every `switch FORMAT` keeps
//! only the cases that name the type (and its `default`), so the block-format kernels
//! (`qmatmul*.wgsl`, `qembed.wgsl`) carry one format's decoding instead of eleven.
//!
//! Why: `FORMAT` is an override constant, and a switch on it folds only after the driver has
//! inlined every function. Mesa's CPU adapters inline first, so each read of the weight carried
//! every format's code until then: compiling the row kernel's 8-window variant for Q8_0 took
//! 7.1 s on lavapipe, and 0.84-1.0 s with only its own cases (the 4-window variants 1.6 s and
//! 0.09-0.11 s). A kept case is the same text, so the kernel computes the same bits.
//!
//! The type is named by its id, the value of the lib's `const GGML_<NAME>: u32 = <id>u;`
//! declarations, which this reads from the lib itself.

/// The `(name, id)` of every `const GGML_<NAME>: u32 = <id>u;` of `lib`, in order (`name`
/// without the `GGML_` prefix).
pub fn format_ids(lib: &str) -> Vec<(&str, u8)> {
    lib.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("const GGML_")?;
            let (name, value) = rest.split_once(": u32 = ")?;
            let id = value.strip_suffix("u;")?.parse().ok()?;
            Some((name, id))
        })
        .collect()
}

/// The lower-case name of the type `id` declares in `lib` (`q4_1`), if it declares one.
pub fn format_name(lib: &str, id: u8) -> Option<String> {
    format_ids(lib)
        .into_iter()
        .find(|&(_, i)| i == id)
        .map(|(name, _)| name.to_ascii_lowercase())
}

/// `lib` with every `switch FORMAT { .. }` reduced to the cases naming type `id` and its
/// `default`. Everything else, comments included, is kept as it is.
pub fn format_source(lib: &str, id: u8) -> String {
    let ids = format_ids(lib);
    let names = |labels: &str| -> bool {
        labels.split(',').any(|label| {
            let label = label.trim();
            ids.iter()
                .any(|&(name, i)| i == id && label.strip_prefix("GGML_") == Some(name))
        })
    };
    const SWITCH: &str = "switch FORMAT {";
    let mut out = String::with_capacity(lib.len());
    let mut rest = lib;
    while let Some(at) = rest.find(SWITCH) {
        let body_start = at + SWITCH.len();
        out.push_str(&rest[..body_start]);
        let Some(body_len) = block_len(&rest[body_start..]) else {
            // An unbalanced switch (not in our lib): keep the rest unchanged.
            out.push_str(&rest[body_start..]);
            return out;
        };
        out.push_str(&kept_cases(
            &rest[body_start..body_start + body_len],
            &names,
        ));
        rest = &rest[body_start + body_len..];
    }
    out.push_str(rest);
    out
}

/// Bytes of `text` up to (not including) the `}` that closes a block opened just before it,
/// skipping `//` comments; `None` when it is not closed.
fn block_len(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut depth = 1usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                i += text[i..].find('\n').unwrap_or(text.len() - i);
                continue;
            }
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Byte index of the first `{` of `text` outside `//` comments.
fn find_open(text: &str) -> Option<usize> {
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let code = line.find("//").map_or(line, |c| &line[..c]);
        if let Some(i) = code.find('{') {
            return Some(at + i);
        }
        at += line.len();
    }
    None
}

/// The items of a switch body (`case A, B: { .. }` and `default: { .. }`, with the comments and
/// blank lines before each) whose labels `keep` accepts, and the default.
fn kept_cases(body: &str, keep: &dyn Fn(&str) -> bool) -> String {
    let mut out = String::new();
    let mut rest = body;
    loop {
        // An item: its header up to `{`, then its block.
        let Some(open) = find_open(rest) else {
            out.push_str(rest);
            return out;
        };
        let Some(len) = block_len(&rest[open + 1..]) else {
            out.push_str(rest);
            return out;
        };
        let end = open + 1 + len + 1;
        let header = rest[..open].trim_end();
        let label = header
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty() && !l.trim_start().starts_with("//"))
            .unwrap_or("")
            .trim();
        let wanted = match label.strip_prefix("case ") {
            Some(labels) => keep(labels.trim_end_matches(':')),
            None => true,
        };
        if wanted {
            out.push_str(&rest[..end]);
        }
        rest = &rest[end..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIB: &str = "const GGML_F32: u32 = 0u;\nconst GGML_Q4_0: u32 = 2u;\n\
        const GGML_Q4_1: u32 = 3u;\nconst GGML_Q8_0: u32 = 8u;\n\
        fn f() -> u32 {\n    switch FORMAT {\n        // F32 {braces} in a comment\n        \
        case GGML_F32: {\n            if true { return 1u; }\n            return 0u;\n        }\n        \
        case GGML_Q4_0, GGML_Q4_1: {\n            return 2u;\n        }\n        \
        default: {}\n    }\n    return 3u;\n}\n";

    #[test]
    fn reads_the_ids_and_names_of_the_lib() {
        assert_eq!(
            format_ids(LIB),
            vec![("F32", 0), ("Q4_0", 2), ("Q4_1", 3), ("Q8_0", 8)]
        );
        assert_eq!(format_name(LIB, 3).as_deref(), Some("q4_1"));
        assert_eq!(format_name(LIB, 9), None);
    }

    #[test]
    fn keeps_the_cases_naming_the_type_and_the_default() {
        let q4_1 = format_source(LIB, 3);
        assert!(q4_1.contains("case GGML_Q4_0, GGML_Q4_1: {\n            return 2u;\n        }"));
        assert!(!q4_1.contains("case GGML_F32"));
        assert!(q4_1.contains("default: {}\n    }\n    return 3u;\n}\n"));
        let f32 = format_source(LIB, 0);
        assert!(f32.contains("case GGML_F32: {\n            if true { return 1u; }"));
        assert!(!f32.contains("case GGML_Q4_0"));
        // Q8_0 takes the default: every named case goes.
        let q8_0 = format_source(LIB, 8);
        assert!(!q8_0.contains("case "));
        assert!(q8_0.contains("switch FORMAT {") && q8_0.contains("default: {}"));
    }

    #[test]
    fn every_type_of_the_real_lib_keeps_a_balanced_source() {
        let lib = crate::shader::LIB_GGML_BLOCKS;
        let ids = format_ids(lib);
        assert_eq!(ids.len(), 11, "the lib declares the 11 types");
        let switches = lib.matches("switch FORMAT {").count();
        assert!(switches >= 4);
        for (name, id) in ids {
            let src = format_source(lib, id);
            assert_eq!(src.matches('{').count(), src.matches('}').count(), "{name}");
            assert_eq!(src.matches("switch FORMAT {").count(), switches, "{name}");
            assert_eq!(src.matches("default:").count(), switches, "{name}");
            assert!(src.len() < lib.len(), "{name}: nothing removed");
            // Only cases naming this type remain.
            for line in src
                .lines()
                .filter(|l| l.trim_start().starts_with("case GGML_"))
            {
                assert!(
                    line.contains(&format!("GGML_{name}")),
                    "{name}: kept {line}"
                );
            }
        }
    }
}
