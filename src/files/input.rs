//! Input files: model files must be regular files (a FIFO with no writer would block `open`
//! forever, a device would stream without end), and every read has a bound checked before and
//! while reading, so no input can exhaust memory.

use std::fs::File;
use std::io::{BufRead, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::exit::{Classify, ExitCode};

/// Why an input was refused or could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{}: is {kind}, not a regular file; model files, packs and state files must be regular files", path.display())]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{}: {size} bytes, more than the {max} bytes {what} may hold", path.display())]
    TooLarge { path: PathBuf, size: u64, max: u64, what: String },
    #[error("{}: {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl Classify for InputError {
    fn exit_code(&self) -> ExitCode {
        match self {
            // A directory where a file belongs cannot be read (as before this check: `EISDIR`).
            InputError::NotRegular { kind: "a directory", .. } => ExitCode::Io,
            InputError::NotRegular { .. } | InputError::TooLarge { .. } => ExitCode::Data,
            InputError::Io { .. } => ExitCode::Io,
        }
    }
}

/// Opens `path` for reading with `flags` (e.g. `O_DIRECT`) only if it is a regular file (after
/// following links). The open itself never blocks: it is non-blocking, and the flag is cleared
/// once the file is known to be regular (io_uring would otherwise answer `EAGAIN`).
pub fn open_regular(path: &Path, flags: i32) -> Result<File, InputError> {
    let io = |op, source| InputError::Io { path: path.to_owned(), op, source };
    // Refused before any open where possible (opening a socket fails with ENXIO, a device's open
    // may act); the check after the open covers what changed in between.
    let meta = std::fs::metadata(path).map_err(|e| io("cannot open", e))?;
    if !meta.is_file() {
        return Err(InputError::NotRegular { path: path.to_owned(), kind: super::kind_of(&meta) });
    }
    let file = File::options()
        .read(true)
        .custom_flags(flags | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| io("cannot open", e))?;
    let meta = file.metadata().map_err(|e| io("cannot stat", e))?;
    if !meta.is_file() {
        return Err(InputError::NotRegular { path: path.to_owned(), kind: super::kind_of(&meta) });
    }
    clear_nonblocking(&file).map_err(|e| io("cannot set blocking mode", e))?;
    Ok(file)
}

fn clear_nonblocking(file: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open for the whole call (borrowed from `file`); F_GETFL/F_SETFL only read
    // and set the file status flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Reads a regular file whole if it holds at most `max` bytes; `what` names what it is in the
/// error ("a config.json").
pub fn read_regular(path: &Path, max: u64, what: &str) -> Result<Vec<u8>, InputError> {
    let file = open_regular(path, 0)?;
    let size = file.metadata().map_err(|source| InputError::Io { path: path.to_owned(), op: "cannot stat", source })?;
    let too_large = |size| InputError::TooLarge { path: path.to_owned(), size, max, what: what.to_owned() };
    if size.len() > max {
        return Err(too_large(size.len()));
    }
    // The size can change after the check; the bound holds while reading too.
    read_bounded(file, max)
        .map_err(|source| InputError::Io { path: path.to_owned(), op: "cannot read", source })?
        .ok_or_else(|| too_large(max + 1))
}

/// Reads `reader` to its end if it holds at most `max` bytes; `None` once it holds more (having
/// read `max + 1`, never more).
pub fn read_bounded(reader: impl Read, max: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    reader.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= max).then_some(bytes))
}

/// One line read by [`read_line_capped`].
#[derive(Debug, PartialEq, Eq)]
pub enum LineRead {
    /// A line (its newline kept, if it had one) is in the buffer.
    Line,
    /// The input ended before any byte.
    End,
    /// The line holds more than the cap; the buffer holds its first `cap + 1` bytes.
    TooLong,
}

/// Reads one line into `buf` (cleared first), reading at most `cap + 1` bytes of it.
pub fn read_line_capped(reader: &mut impl BufRead, buf: &mut Vec<u8>, cap: usize) -> std::io::Result<LineRead> {
    buf.clear();
    let n = reader.by_ref().take(cap as u64 + 1).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(LineRead::End);
    }
    if buf.len() > cap && buf.last() != Some(&b'\n') {
        return Ok(LineRead::TooLong);
    }
    Ok(LineRead::Line)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn special_files_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("config.json");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let err = open_regular(&fifo, 0).unwrap_err();
        assert_eq!(err.exit_code(), ExitCode::Data);
        assert!(err.to_string().starts_with(&format!("{}: is a FIFO, not a regular file", fifo.display())), "{err}");
        let err = read_regular(Path::new("/dev/zero"), 1 << 20, "a config.json").unwrap_err();
        assert!(err.to_string().contains("is a character device"), "{err}");
        assert!(matches!(open_regular(dir.path(), 0), Err(InputError::NotRegular { kind: "a directory", .. })));
        let socket = dir.path().join("tiktoken.model");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let err = open_regular(&socket, 0).unwrap_err();
        assert_eq!(err.exit_code(), ExitCode::Data);
        assert!(err.to_string().contains("is a socket, not a regular file"), "{err}");
        let err = open_regular(&dir.path().join("missing"), 0).unwrap_err();
        assert_eq!(err.exit_code(), ExitCode::Io);
    }

    #[test]
    fn reads_stop_at_their_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![b'x'; 100]).unwrap();
        assert_eq!(read_regular(&path, 100, "f").unwrap().len(), 100);
        let err = read_regular(&path, 99, "a config.json").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("{}: 100 bytes, more than the 99 bytes a config.json may hold", path.display())
        );
        let zero = File::open("/dev/zero").unwrap();
        assert_eq!(read_bounded(zero, 1000).unwrap(), None);
        assert_eq!(read_bounded(&b"abc"[..], 3).unwrap(), Some(b"abc".to_vec()));
        let mut input = &b"one\ntwo-long-line\nlast"[..];
        let mut buf = Vec::new();
        assert_eq!(read_line_capped(&mut input, &mut buf, 8).unwrap(), LineRead::Line);
        assert_eq!(buf, b"one\n");
        assert_eq!(read_line_capped(&mut input, &mut buf, 8).unwrap(), LineRead::TooLong);
        assert_eq!(buf.len(), 9);
        let mut zeros = std::io::BufReader::new(File::open("/dev/zero").unwrap());
        assert_eq!(read_line_capped(&mut zeros, &mut buf, 1 << 16).unwrap(), LineRead::TooLong);
        let mut exact = &b"12345678\n"[..];
        assert_eq!(read_line_capped(&mut exact, &mut buf, 8).unwrap(), LineRead::Line);
        assert_eq!(read_line_capped(&mut exact, &mut buf, 8).unwrap(), LineRead::End);
    }
}
