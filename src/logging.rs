//! Log set-up shared by the binaries: `tracing` to stderr, filtered by `RUST_LOG` (default
//! `warn`), with ANSI colours only when stderr is a terminal and `NO_COLOR` is unset or empty
//! (<https://no-color.org>).

use std::io::IsTerminal;

/// Whether log lines may carry ANSI colour codes: stderr is a terminal and `NO_COLOR` is not set
/// to a non-empty value.
pub fn colour_allowed(stderr_is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Installs the global subscriber; a second call is a no-op.
pub fn init() {
    let ansi = colour_allowed(std::io::stderr().is_terminal(), std::env::var_os("NO_COLOR").as_deref());
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_env_filter(filter)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::colour_allowed;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour_allowed(true, None));
        assert!(colour_allowed(true, Some(OsStr::new(""))));
        assert!(!colour_allowed(true, Some(OsStr::new("1"))));
        assert!(!colour_allowed(false, None));
    }
}
