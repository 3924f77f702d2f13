//! Usage errors of the subcommands that report every error as one line (`serve-bench`,
//! `bench`): clap's message cut to its first line.

/// Subcommands whose usage errors are one line on stderr like their other errors.
const ONE_LINE: [&str; 2] = ["serve-bench", "bench"];

/// The subcommand whose usage error `e` is, when it is one of [`ONE_LINE`] and `e` is not
/// `--help` or `--version`.
pub fn one_line_subcommand(e: &clap::Error) -> Option<&'static str> {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        return None;
    }
    let first = std::env::args().nth(1)?;
    ONE_LINE.into_iter().find(|&name| name == first)
}

/// The first line of clap's message, without its `error: ` prefix.
pub fn usage_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    line.trim().trim_start_matches("error: ").to_string()
}
