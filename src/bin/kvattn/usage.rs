//! Usage errors as one line, like every other error of the command line: clap's message
//! without its usage block, prefixed with the subcommand it is about.

use std::ffi::OsString;

use clap::error::ErrorKind;

/// The one-line form of the usage error `e` of `cmd` (the whole command line's definition)
/// parsed from `args` (the program name first): `SUBCOMMAND: message`, or the message alone
/// for an error before any subcommand. `None` for `--help`, `--version` and a command called
/// with nothing, which print their text in full.
pub fn one_line(e: &clap::Error, cmd: &clap::Command, args: &[OsString]) -> Option<String> {
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        return None;
    }
    let message = message(&e.to_string());
    let path = subcommand_path(cmd, args);
    Some(if path.is_empty() {
        message
    } else {
        format!("{}: {message}", path.join(" "))
    })
}

/// The subcommands named at the start of `args` (after the program name), e.g. `run attention`.
fn subcommand_path(cmd: &clap::Command, args: &[OsString]) -> Vec<String> {
    let mut path = Vec::new();
    let mut cmd = cmd;
    for arg in args.iter().skip(1) {
        let Some(sub) = arg.to_str().and_then(|a| cmd.find_subcommand(a)) else {
            break;
        };
        path.push(sub.get_name().to_string());
        cmd = sub;
    }
    path
}

/// clap's rendered message as one line: its paragraphs up to the usage block, the `error: `
/// prefix dropped, lines of a list joined with commas, paragraphs (tips) with `; `.
fn message(text: &str) -> String {
    let mut parts = Vec::new();
    for para in text.split("\n\n") {
        let para = para.trim();
        if para.starts_with("Usage:") || para.starts_with("For more information") {
            break;
        }
        let mut lines = para.lines().map(str::trim).filter(|l| !l.is_empty());
        let Some(first) = lines.next() else {
            continue;
        };
        let rest: Vec<&str> = lines.collect();
        let first = first.trim_start_matches("error: ");
        parts.push(if rest.is_empty() {
            first.to_string()
        } else {
            format!("{first} {}", rest.join(", "))
        });
    }
    let line = parts.join("; ");
    // Whatever the message held, one line.
    line.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clap_messages_become_one_line() {
        let text = "error: the following required arguments were not provided:\n  --in <CASE>\n  \
                    --out <RESULT>\n\nUsage: kvattn run attention --in <CASE> --out <RESULT>\n\n\
                    For more information, try '--help'.\n";
        assert_eq!(
            message(text),
            "the following required arguments were not provided: --in <CASE>, --out <RESULT>"
        );
        let text = "error: unexpected argument '--kv-dtype' found\n\n  tip: a similar argument \
                    exists: '--dtype'\n\nUsage: kvattn capacity --dtype <DTYPE>\n\nFor more \
                    information, try '--help'.\n";
        assert_eq!(
            message(text),
            "unexpected argument '--kv-dtype' found; tip: a similar argument exists: '--dtype'"
        );
    }
}
