//! The one tracing subscriber of the process: library `tracing` events (warnings such as a
//! registration fallback or unlocked buffers) go to stderr as `k3ring: warning: ...` lines, like
//! the `k3ring: error: ...` line `main` prints. Installed once, by `main`, after the flags parse.

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::{EnvFilter, LevelFilter};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The level `-v` given `verbose` times asks for: warnings by default, then info, debug, trace.
pub fn level_for(verbose: u8) -> LevelFilter {
    match verbose {
        0 => LevelFilter::WARN,
        1 => LevelFilter::INFO,
        2 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

/// The filter: `RUST_LOG` when it is set and non-empty (it replaces `-v`, and can pick modules,
/// e.g. `RUST_LOG=k3ring::storage=debug`), else the level of `-v`. An unparsable `RUST_LOG` is
/// reported and `-v` used instead, so a typo neither silences warnings nor stops the run.
fn filter(verbose: u8, rust_log: Option<&str>) -> (EnvFilter, Option<String>) {
    let fallback = || EnvFilter::default().add_directive(level_for(verbose).into());
    match rust_log.map(str::trim).filter(|s| !s.is_empty()) {
        None => (fallback(), None),
        Some(spec) => match EnvFilter::try_new(spec) {
            Ok(f) => (f, None),
            Err(e) => (fallback(), Some(format!("RUST_LOG={spec:?} is not a valid filter ({e}); using -v instead"))),
        },
    }
}

/// Installs the subscriber (once; a second call does nothing).
pub fn install(verbose: u8) {
    let rust_log = std::env::var("RUST_LOG").ok();
    let (filter, problem) = filter(verbose, rust_log.as_deref());
    let installed = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .event_format(Short)
        .try_init()
        .is_ok();
    if let (true, Some(problem)) = (installed, problem) {
        tracing::warn!("{problem}");
    }
}

/// `k3ring: warning: message key=value`; debug and trace lines also name the module they come
/// from. No timestamps or colours: these lines sit among the run's own stderr lines.
struct Short;

impl<S, N> FormatEvent<S, N> for Short
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let meta = event.metadata();
        let level = match *meta.level() {
            Level::ERROR => "error",
            Level::WARN => "warning",
            Level::INFO => "info",
            Level::DEBUG => "debug",
            Level::TRACE => "trace",
        };
        write!(writer, "k3ring: {level}: ")?;
        if *meta.level() >= Level::DEBUG {
            write!(writer, "{}: ", meta.target().trim_start_matches("k3ring::"))?;
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_v_raises_the_level_and_rust_log_replaces_it() {
        let levels: Vec<LevelFilter> = (0..5).map(level_for).collect();
        let want = [LevelFilter::WARN, LevelFilter::INFO, LevelFilter::DEBUG, LevelFilter::TRACE, LevelFilter::TRACE];
        assert_eq!(levels, want);
        assert_eq!(filter(0, None).0.max_level_hint(), Some(LevelFilter::WARN));
        assert_eq!(filter(2, Some("  ")).0.max_level_hint(), Some(LevelFilter::DEBUG));
        assert_eq!(filter(2, Some("error")).0.max_level_hint(), Some(LevelFilter::ERROR));
        let (f, problem) = filter(1, Some("k3ring=notalevel"));
        assert_eq!(f.max_level_hint(), Some(LevelFilter::INFO));
        assert!(problem.is_some_and(|p| p.starts_with("RUST_LOG=\"k3ring=notalevel\" is not a valid filter")));
    }
}
