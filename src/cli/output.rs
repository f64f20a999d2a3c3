//! Output files named by flags (`--json`, `--trace`, `--dump-trace`, `--logits`), the same in
//! every subcommand: each is created when the command starts, before any model is opened, so a
//! bad path fails at once (exit 4 naming the flag and the path) rather than after minutes of
//! work; it is written at the end, also after Ctrl-C, with what was done.
//!
//! `--json FILE` writes the command's report to FILE; `--json -` writes it to stdout instead of
//! the text the command would print there (a table, a summary, or `run`'s generated text, which
//! the report holds).

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;

use crate::error::UsageError;

/// The value of a file flag that means stdout.
pub const STDOUT: &str = "-";

/// Creates (or truncates) the file `flag` names, now. For flags that cannot take `-`.
pub fn create_now(flag: &str, path: &Path) -> anyhow::Result<()> {
    if path.as_os_str() == STDOUT {
        return Err(UsageError(format!("{flag} takes a file name; {flag} - (stdout) is not supported")).into());
    }
    // A FIFO or a device (`/dev/stdout`) is opened when it is written: opening a FIFO blocks
    // until a reader comes, and a device needs no creating.
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir()) {
        return Ok(());
    }
    std::fs::File::create(path).with_context(|| format!("{flag} {}: cannot create the file", path.display()))?;
    Ok(())
}

/// Where a `--json` report goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonOut {
    Stdout,
    /// A file, created when the command started.
    File(PathBuf),
}

impl JsonOut {
    /// Resolves `--json` and creates its file now; `None` when the flag is absent.
    pub fn open(path: Option<&Path>) -> anyhow::Result<Option<JsonOut>> {
        let Some(path) = path else { return Ok(None) };
        if path.as_os_str() == STDOUT {
            return Ok(Some(JsonOut::Stdout));
        }
        create_now("--json", path)?;
        Ok(Some(JsonOut::File(path.to_path_buf())))
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
            JsonOut::File(path) => {
                std::fs::write(path, text).with_context(|| format!("writing --json {}", path.display()))
            }
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
    fn json_out_creates_its_file_at_once_and_names_a_bad_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.json");
        let out = JsonOut::open(Some(&path)).unwrap().unwrap();
        assert!(path.exists(), "created before any work");
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
