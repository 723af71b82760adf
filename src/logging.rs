//! Log set-up shared by the binaries: `tracing` to stderr, filtered by `RUST_LOG` (default
//! `warn`), with ANSI colours only when stderr is a terminal and `NO_COLOR` is unset or empty
//! (<https://no-color.org>); and `say!`, a stderr line in one write, for the ranks and the
//! launcher that share one stderr.

use std::io::{IsTerminal, Write};

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

/// Writes `line` and a newline to `out` in one `write` where the writer takes it whole. Ranks of
/// one job share their launcher's stderr: a line written in pieces (as `eprintln!` writes its
/// arguments) interleaves with another rank's, and a pipe keeps a single write of up to 4 KiB
/// in one piece.
pub fn write_line(out: &mut impl Write, line: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    let mut text = std::fmt::format(line);
    text.push('\n');
    out.write_all(text.as_bytes())
}

/// `eprintln!` for processes that share a stderr: the line goes out in one write
/// ([`write_line`]); a failed write is ignored, as `eprintln!` cannot report it either.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = $crate::logging::write_line(&mut ::std::io::stderr().lock(), ::std::format_args!($($arg)*));
    }};
}
pub use crate::say;

#[cfg(test)]
mod tests {
    use super::{colour_allowed, write_line};
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour_allowed(true, None));
        assert!(colour_allowed(true, Some(OsStr::new(""))));
        assert!(!colour_allowed(true, Some(OsStr::new("1"))));
        assert!(!colour_allowed(false, None));
    }

    /// Counts the writes it is given.
    struct Writes(Vec<Vec<u8>>);

    impl std::io::Write for Writes {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_with_arguments_goes_out_in_one_write() {
        let mut w = Writes(Vec::new());
        let (step, file) = (4, "/ckpt/rank-00001.safetensors.tmp");
        write_line(&mut w, format_args!("smp-runner: error: checkpoint of step {step} not written: {file}: no space")).unwrap();
        assert_eq!(w.0.len(), 1, "{:?}", w.0);
        assert_eq!(String::from_utf8_lossy(&w.0[0]), format!("smp-runner: error: checkpoint of step {step} not written: {file}: no space\n"));
    }
}
