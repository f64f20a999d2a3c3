//! Output files: one writing rule for every flag that names one (`--json`, `--trace`,
//! `--dump-trace`, `--logits`, `--csv`, `--svg`, `--save-state`, `--history`, `--output`,
//! `--record`, chat's `/save`).
//!
//! - `-` is stdout, for the flags that document it; so are `/dev/stdout` and `/dev/stderr`
//!   (written through the process's own handle), and `/dev/null` is written in place.
//! - A FIFO is written in place, as a shell's `>` would: the command waits for its reader there
//!   (a routing trace can be read live, `k3ring cache-sim` on the other end).
//! - A symbolic link is followed to its target, and the rule applies to the target.
//! - A regular file, or a name that does not exist yet, is replaced atomically: a temporary file
//!   in the target's directory, fsync, rename over the target, fsync of the directory; a failed
//!   or interrupted write leaves the old file whole. An existing file keeps its permissions.
//! - Anything else (a directory, a device, a socket) is refused with exit 2 naming the flag,
//!   before any work, and never replaced.
//!
//! [`Output::resolve`] applies the rule when the command starts, and proves the directory
//! writable by creating and removing a temporary file there, so a bad path fails at once rather
//! than after minutes of work.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::exit::{Classify, ExitCode};

/// The value of a file flag that means stdout.
pub const STDOUT: &str = "-";

/// Symbolic links followed at most, as the kernel's own limit (`ELOOP`).
const MAX_LINKS: usize = 40;

/// Why an output file was refused or could not be written.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("{flag} {}: {why}", path.display())]
    Refused { flag: String, path: PathBuf, why: String },
    #[error("{flag} {}: {op}: {source}", path.display())]
    Io {
        flag: String,
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl Classify for OutputError {
    fn exit_code(&self) -> ExitCode {
        match self {
            OutputError::Refused { .. } => ExitCode::Usage,
            OutputError::Io { .. } => ExitCode::Io,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Stdout,
    Stderr,
    /// A device or FIFO written where it is (`/dev/null`, a FIFO).
    InPlace(PathBuf),
    /// A regular file (or a new one) replaced atomically; the path after following links.
    Replace(PathBuf),
}

/// An output file flag, resolved by the rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    flag: String,
    /// As the user gave it, for messages.
    given: PathBuf,
    target: Target,
}

impl Output {
    /// Applies the rule to `path`, given to `flag`; `stdout_ok` says whether the flag takes `-`.
    pub fn resolve(flag: &str, path: &Path, stdout_ok: bool) -> Result<Output, OutputError> {
        Output::resolve_as(flag, path, stdout_ok, true)
    }

    /// [`Output::resolve`] for files meant to be read back whole (state files, histories, the
    /// trunk pack's files): a FIFO is refused too, since nothing could read them back from it
    /// and a FIFO without a reader would hold the command at its end.
    pub fn resolve_file(flag: &str, path: &Path) -> Result<Output, OutputError> {
        Output::resolve_as(flag, path, false, false)
    }

    fn resolve_as(flag: &str, path: &Path, stdout_ok: bool, fifo_ok: bool) -> Result<Output, OutputError> {
        use std::os::unix::fs::FileTypeExt;
        let refused = |why: String| OutputError::Refused { flag: flag.to_owned(), path: path.to_owned(), why };
        let make = |target| Ok(Output { flag: flag.to_owned(), given: path.to_owned(), target });
        if path.as_os_str() == STDOUT {
            if !stdout_ok {
                return Err(refused(format!("{flag} takes a file name; {flag} - (stdout) is not supported")));
            }
            return make(Target::Stdout);
        }
        match path.to_str() {
            Some("/dev/stdout") => return make(Target::Stdout),
            Some("/dev/stderr") => return make(Target::Stderr),
            _ => {}
        }
        // The kernel's view first: it resolves links such as `/dev/fd/63` (a pipe from `>(cmd)`)
        // that name no path, which are written where they are.
        let meta = std::fs::metadata(path);
        let what = match &meta {
            Ok(m) if m.is_file() => None,
            Ok(m) if m.file_type().is_fifo() && fifo_ok => return make(Target::InPlace(path.to_owned())),
            Ok(m)
                if m.file_type().is_char_device()
                    && std::fs::canonicalize(path).is_ok_and(|c| c == Path::new("/dev/null")) =>
            {
                return make(Target::InPlace(path.to_owned()));
            }
            Ok(m) => Some(super::kind_of(m)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(_) => None,
        };
        if let Some(kind) = what {
            let stdout = if stdout_ok { "- for stdout, " } else { "" };
            let fifo = if fifo_ok { "a FIFO, " } else { "" };
            return Err(refused(format!(
                "is {kind}; k3ring writes only regular files (replacing them whole), {stdout}{fifo}or /dev/null, and \
                 refuses to write here; name a file"
            )));
        }
        let target = follow_links(path).map_err(&refused)?;
        if let Err(source) = meta {
            if source.kind() != std::io::ErrorKind::NotFound {
                return Err(OutputError::Io {
                    flag: flag.to_owned(),
                    path: path.to_owned(),
                    op: "cannot stat",
                    source,
                });
            }
        }
        let out = Output { flag: flag.to_owned(), given: path.to_owned(), target: Target::Replace(target) };
        // Proves the directory writable now: create and remove a temporary file.
        let (tmp, file) = out.create_temp().map_err(|e| out.io("cannot create the file", e))?;
        drop(file);
        let _ = std::fs::remove_file(&tmp);
        Ok(out)
    }

    /// The path as the user gave it.
    pub fn path(&self) -> &Path {
        &self.given
    }

    /// The flag it was given to.
    pub fn flag(&self) -> &str {
        &self.flag
    }

    /// The regular file the output replaces, after following links (`None` for stdout and
    /// devices written in place).
    pub fn target(&self) -> Option<&Path> {
        match &self.target {
            Target::Replace(target) => Some(target),
            _ => None,
        }
    }

    /// Whether the bytes go to stdout (where a command prints its own text otherwise).
    pub fn is_stdout(&self) -> bool {
        self.target == Target::Stdout
    }

    /// Writes `bytes` as the whole output.
    pub fn write_all(&self, bytes: &[u8]) -> Result<(), OutputError> {
        let mut w = self.create()?;
        w.write_all(bytes).map_err(|e| self.io("writing", e))?;
        w.finish()
    }

    /// A writer for output made piece by piece; nothing replaces the target until
    /// [`OutputWriter::finish`], and a writer dropped unfinished leaves the target as it was.
    pub fn create(&self) -> Result<OutputWriter, OutputError> {
        let sink = match &self.target {
            Target::Stdout => Sink::Stdout(std::io::stdout()),
            Target::Stderr => Sink::Stderr(std::io::stderr()),
            Target::InPlace(path) => {
                let file = File::options().write(true).open(path).map_err(|e| self.io("cannot open", e))?;
                Sink::File(BufWriter::new(file))
            }
            Target::Replace(target) => {
                let (tmp, file) = self.create_temp().map_err(|e| self.io("cannot create the file", e))?;
                if let Ok(meta) = std::fs::metadata(target) {
                    let _ = file.set_permissions(meta.permissions());
                }
                return Ok(OutputWriter {
                    out: self.clone(),
                    sink: Sink::File(BufWriter::new(file)),
                    pending: Some((tmp, target.clone())),
                });
            }
        };
        Ok(OutputWriter { out: self.clone(), sink, pending: None })
    }

    /// The error of `op` failing on this output, naming its flag and path.
    pub fn io(&self, op: &'static str, source: std::io::Error) -> OutputError {
        OutputError::Io { flag: self.flag.clone(), path: self.given.clone(), op, source }
    }

    /// A new temporary file beside the target (only for [`Target::Replace`]): a name no other
    /// process or earlier run can hold (pid, a counter, the clock), created exclusively so that
    /// nothing planted at that name is followed.
    fn create_temp(&self) -> std::io::Result<(PathBuf, File)> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let Target::Replace(target) = &self.target else {
            return Err(std::io::Error::other("not a file to replace"));
        };
        let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let dir = parent_dir(target);
        loop {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let nanos =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
            let tmp = dir.join(format!(".{name}.k3ring-{}-{n}-{nanos:x}.tmp", std::process::id()));
            match File::options().write(true).create_new(true).open(&tmp) {
                Ok(file) => return Ok((tmp, file)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// The directory a path's file lives in (`.` for a bare name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    }
}

/// Follows symbolic links from `path` to a path that is not one (which may not exist yet).
fn follow_links(path: &Path) -> Result<PathBuf, String> {
    let mut at = path.to_owned();
    for _ in 0..MAX_LINKS {
        match std::fs::symlink_metadata(&at) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let link =
                    std::fs::read_link(&at).map_err(|e| format!("cannot read the link {}: {e}", at.display()))?;
                at = if link.is_absolute() { link } else { parent_dir(&at).join(link) };
            }
            _ => return Ok(at),
        }
    }
    Err(format!("more than {MAX_LINKS} symbolic links to follow"))
}

enum Sink {
    Stdout(std::io::Stdout),
    Stderr(std::io::Stderr),
    File(BufWriter<File>),
}

/// Writes an [`Output`]; see [`Output::create`].
pub struct OutputWriter {
    out: Output,
    sink: Sink,
    /// The temporary file and the target it replaces on `finish`.
    pending: Option<(PathBuf, PathBuf)>,
}

impl Write for OutputWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &mut self.sink {
            Sink::Stdout(s) => s.write(buf),
            Sink::Stderr(s) => s.write(buf),
            Sink::File(f) => f.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.sink {
            Sink::Stdout(s) => s.flush(),
            Sink::Stderr(s) => s.flush(),
            // A file's bytes are flushed (and synced) by `finish`; flushing a temporary file
            // early would only cost writes.
            Sink::File(_) if self.pending.is_some() => Ok(()),
            Sink::File(f) => f.flush(),
        }
    }
}

impl OutputWriter {
    /// Flushes, and for a regular file syncs it and renames it over the target.
    pub fn finish(mut self) -> Result<(), OutputError> {
        let out = self.out.clone();
        let sink = std::mem::replace(&mut self.sink, Sink::Stderr(std::io::stderr()));
        match sink {
            Sink::Stdout(mut s) => s.flush().map_err(|e| out.io("writing", e))?,
            Sink::Stderr(mut s) => s.flush().map_err(|e| out.io("writing", e))?,
            Sink::File(f) => {
                let file = f.into_inner().map_err(|e| out.io("writing", e.into_error()))?;
                if self.pending.is_none() {
                    return Ok(());
                }
                file.sync_all().map_err(|e| out.io("writing", e))?;
            }
        }
        let Some((tmp, target)) = self.pending.take() else { return Ok(()) };
        // The target was checked when the command started; something else may stand there now.
        if let Ok(meta) = std::fs::symlink_metadata(&target) {
            if !meta.is_file() {
                let _ = std::fs::remove_file(&tmp);
                let why = format!("became {} while the command ran; nothing was written there", super::kind_of(&meta));
                return Err(OutputError::Refused { flag: out.flag.clone(), path: out.given.clone(), why });
            }
        }
        if let Err(e) = std::fs::rename(&tmp, &target) {
            let _ = std::fs::remove_file(&tmp);
            return Err(out.io("cannot replace the file", e));
        }
        // The rename is durable once the directory is; failing here loses nothing written.
        if let Ok(d) = File::open(parent_dir(&target)) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for OutputWriter {
    fn drop(&mut self) {
        if let Some((tmp, _)) = self.pending.take() {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn regular_files_are_replaced_whole_and_links_followed() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("r.json");
        std::fs::write(&file, "old").unwrap();
        let out = Output::resolve("--json", &file, true).unwrap();
        let mut w = out.create().unwrap();
        w.write_all(b"new").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"old", "nothing replaced before finish");
        drop(w);
        assert_eq!(std::fs::read(&file).unwrap(), b"old", "an unfinished writer leaves the old file");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file left");
        out.write_all(b"new").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
        // A link is followed: the target changes, the link stays a link.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("r.json", &link).unwrap();
        Output::resolve("--json", &link, true).unwrap().write_all(b"via link").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
        assert_eq!(std::fs::read(&file).unwrap(), b"via link");
        // A dangling link makes its target.
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink("made.json", &dangling).unwrap();
        Output::resolve("--json", &dangling, true).unwrap().write_all(b"made").unwrap();
        assert_eq!(std::fs::read(dir.path().join("made.json")).unwrap(), b"made");
    }

    #[test]
    fn anything_but_a_regular_file_or_fifo_is_refused_naming_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("socket");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let err = Output::resolve("--trace", &socket, false).unwrap_err();
        assert_eq!(err.exit_code(), ExitCode::Usage);
        assert!(err.to_string().starts_with(&format!("--trace {}: is a socket", socket.display())), "{err}");
        let err = Output::resolve("--csv", dir.path(), false).unwrap_err();
        assert!(err.to_string().contains("is a directory"), "{err}");
        let link = dir.path().join("to-socket");
        std::os::unix::fs::symlink(&socket, &link).unwrap();
        let err = Output::resolve("--json", &link, true).unwrap_err();
        assert!(err.to_string().contains("is a socket;"), "{err}");
        // Only files meant to be read back refuse a FIFO.
        let fifo2 = dir.path().join("fifo2");
        assert!(std::process::Command::new("mkfifo").arg(&fifo2).status().unwrap().success());
        let err = Output::resolve_file("--save-state", &fifo2).unwrap_err();
        assert!(err.to_string().contains("is a FIFO; k3ring writes only regular files"), "{err}");
        // A link to /dev/null is /dev/null.
        let null = dir.path().join("null");
        std::os::unix::fs::symlink("/dev/null", &null).unwrap();
        Output::resolve("--json", &null, true).unwrap().write_all(b"x").unwrap();
        // A target replaced by something else while the command ran is not replaced.
        let later = dir.path().join("later");
        let out = Output::resolve("--json", &later, true).unwrap();
        let w = out.create().unwrap();
        std::fs::create_dir(&later).unwrap();
        assert!(matches!(w.finish(), Err(OutputError::Refused { .. })));
        assert!(std::fs::metadata(&later).unwrap().is_dir());
        // A FIFO is written in place (its reader gets the bytes), never replaced.
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let out = Output::resolve("--json", &fifo, true).unwrap();
        let reader = std::thread::spawn({
            let fifo = fifo.clone();
            move || std::fs::read(fifo).unwrap()
        });
        out.write_all(b"through the pipe").unwrap();
        assert_eq!(reader.join().unwrap(), b"through the pipe");
        assert!(!std::fs::metadata(&fifo).unwrap().is_file(), "the FIFO is untouched");
        let err = Output::resolve("--trace", Path::new("-"), false).unwrap_err();
        assert_eq!(err.exit_code(), ExitCode::Usage);
        assert!(Output::resolve("--json", Path::new("-"), true).unwrap().is_stdout());
        assert!(Output::resolve("--json", Path::new("/dev/stdout"), true).unwrap().is_stdout());
        Output::resolve("--json", Path::new("/dev/null"), true).unwrap().write_all(b"x").unwrap();
        let missing = dir.path().join("missing/r.json");
        let err = Output::resolve("--json", &missing, true).unwrap_err();
        assert_eq!(err.exit_code(), ExitCode::Io);
        assert!(err.to_string().contains(&format!("--json {}: cannot create the file", missing.display())), "{err}");
    }
}
