//! Output files named by flags (`--json`, `--trace`, `--dump-trace`, `--logits`, ...), the same
//! in every subcommand: each is checked by the output rule (`crate::files::output`) when the
//! command starts, before any model is opened, so a bad path fails at once (exit 2 for what k3ring
//! refuses to replace, exit 4 for a directory it cannot write, naming the flag and the path)
//! rather than after minutes of work; it is written at the end, also after Ctrl-C, with what was
//! done.
//!
//! `--json FILE` writes the command's report to FILE; `--json -` writes it to stdout instead of
//! the text the command would print there (a table, a summary, or `run`'s generated text, which
//! the report holds).

use std::path::Path;

use anyhow::Context;
use serde::Serialize;

pub use crate::files::output::STDOUT;
use crate::files::Output;

/// Applies the output rule (`crate::files::output`) to the file `flag` names, now, for a flag
/// that cannot take `-`: a bad path fails before any work. The file itself is written at the end.
pub fn create_now(flag: &str, path: &Path) -> anyhow::Result<Output> {
    Ok(Output::resolve(flag, path, false)?)
}

/// [`create_now`] for a file meant to be read back whole (`--save-state`, `--history`): a FIFO
/// is refused too.
pub fn create_file_now(flag: &str, path: &Path) -> anyhow::Result<Output> {
    Ok(Output::resolve_file(flag, path)?)
}

/// Where a `--json` report goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonOut {
    Stdout,
    /// A file (or device) checked when the command started.
    File(Output),
}

impl JsonOut {
    /// Resolves `--json` by the output rule, now; `None` when the flag is absent.
    pub fn open(path: Option<&Path>) -> anyhow::Result<Option<JsonOut>> {
        let Some(path) = path else { return Ok(None) };
        let out = Output::resolve("--json", path, true)?;
        Ok(Some(if out.is_stdout() { JsonOut::Stdout } else { JsonOut::File(out) }))
    }

    /// Whether the report replaces the command's text on stdout.
    pub fn is_stdout(out: Option<&JsonOut>) -> bool {
        out == Some(&JsonOut::Stdout)
    }

    /// Writes `report` as pretty JSON with a final newline.
    pub fn write<T: Serialize>(&self, report: &T) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(report)? + "\n";
        match self {
            JsonOut::Stdout => {
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                out.write_all(text.as_bytes()).and_then(|()| out.flush()).context("writing --json - to stdout")
            }
            JsonOut::File(out) => Ok(out.write_all(text.as_bytes())?),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::error::exit_code_for;
    use crate::exit::ExitCode;

    #[test]
    fn json_out_checks_its_file_at_once_and_names_a_bad_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.json");
        let out = JsonOut::open(Some(&path)).unwrap().unwrap();
        assert!(!path.exists(), "checked before any work, written at the end");
        out.write(&serde_json::json!({"a": 1})).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\n  \"a\": 1\n}\n");
        assert_eq!(JsonOut::open(Some(Path::new("-"))).unwrap(), Some(JsonOut::Stdout));
        assert_eq!(JsonOut::open(None).unwrap(), None);
        let bad = dir.path().join("missing/r.json");
        let err = JsonOut::open(Some(&bad)).unwrap_err();
        assert_eq!(exit_code_for(&err), ExitCode::Io);
        assert!(err.to_string().contains(&format!("--json {}", bad.display())), "{err}");
        let err = create_now("--trace", Path::new("-")).unwrap_err();
        assert_eq!(exit_code_for(&err), ExitCode::Usage);
        // Not opened (it would block until a reader came), and not replaced by a file.
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        create_now("--dump-trace", &fifo).unwrap();
        assert!(!std::fs::metadata(&fifo).unwrap().is_file());
    }
}
