//! [`IoError`]: every failure of the read layer, each naming the file, offset and operation.

use std::path::PathBuf;

use super::fmt_bytes;
use crate::exit::{Classify, ExitCode};

/// Why a read, a buffer or a ring could not be set up or completed.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// A file could not be opened for direct reads.
    #[error("cannot open {path} for O_DIRECT reads: {source}")]
    Open { path: PathBuf, source: std::io::Error },

    /// The kernel failed a read (any errno but EINTR/EAGAIN, or those after the retry limit).
    #[error("read of {len} bytes at offset {offset} of {path} failed: {source}")]
    Read { path: PathBuf, offset: u64, len: usize, source: std::io::Error },

    /// The file ended before the bytes the read required (`min_len`): the data is at fault (exit 3).
    #[error(
        "{path} ends early: a read at offset {offset} needs {wanted} bytes but the file holds only {got}; \
         the file is shorter than the checkpoint index says"
    )]
    ShortRead { path: PathBuf, offset: u64, wanted: usize, got: usize },

    /// An offset, length or address is not a multiple of the direct-I/O alignment.
    #[error("{what} is {value}, not a multiple of the direct-I/O alignment {align}")]
    Unaligned { what: String, value: u64, align: u32 },

    /// `RLIMIT_MEMLOCK` is below what locking or registering the buffers needs.
    #[error(
        "RLIMIT_MEMLOCK is {}; the buffers need {}, counted once for mlock and once more for io_uring: \
         raise it to twice that (`ulimit -l {}`, in KiB) or set LimitMEMLOCK=infinity",
        fmt_bytes(*have), fmt_bytes(*need), memlock_kib_advised(*need)
    )]
    MemLock { have: u64, need: u64 },

    /// A buffer could not be mapped.
    #[error("cannot map {} of read buffers: {source}", fmt_bytes(*bytes))]
    Alloc { bytes: u64, source: std::io::Error },

    /// `mbind` refused to place a buffer on a NUMA node.
    #[error("cannot bind {} of read buffers to NUMA node {node}: {source}; check `--numa-node` against /sys/devices/system/node", fmt_bytes(*bytes))]
    Mbind { node: u32, bytes: u64, source: std::io::Error },

    /// A ring, a registration or a worker thread could not be set up.
    #[error("cannot set up {what}: {source}")]
    Setup { what: String, source: std::io::Error },

    /// `io_uring_enter` failed for a reason other than EINTR/EAGAIN.
    #[error("io_uring_enter failed while {what}: {source}")]
    Enter { what: &'static str, source: std::io::Error },

    /// More reads were queued than the reader reserved room for.
    #[error("read {tag} refused: {queued} reads already queued, the limit is {max}; reap completions first")]
    QueueFull { tag: u64, queued: usize, max: usize },

    /// A read op is malformed (bad file index, zero length, `min_len > len`, buffer mismatch): the
    /// engine built it wrongly, so it is a bug (exit 1), not an I/O failure.
    #[error("read {tag} refused: {why}")]
    BadOp { tag: u64, why: String },

    /// A sysfs topology file could not be read.
    #[error("cannot read {path}: {source}")]
    Sysfs { path: PathBuf, source: std::io::Error },

    /// A sysfs cpu list is malformed.
    #[error("{path}: malformed cpu list {text:?}: {why}")]
    CpuList { path: PathBuf, text: String, why: String },
}

/// docs/USAGE.md "Exit codes": 3 when the data is at fault (a file shorter than the checkpoint says), 1
/// for the engine's own bug (an unaligned or malformed op, a queue overrun: the engine built or
/// queued the request wrongly), 4 for every I/O or system failure.
/// The `ulimit -l` value (KiB) that the MemLock message advises for `need` bytes: locked buffers
/// count against RLIMIT_MEMLOCK once for `mlock` and once more when io_uring registers them.
pub(crate) fn memlock_kib_advised(need: u64) -> u64 {
    need.saturating_mul(2).div_ceil(1024)
}

impl Classify for IoError {
    fn exit_code(&self) -> ExitCode {
        match self {
            IoError::ShortRead { .. } => ExitCode::Data,
            IoError::Unaligned { .. } | IoError::QueueFull { .. } | IoError::BadOp { .. } => ExitCode::Internal,
            IoError::Open { .. }
            | IoError::Read { .. }
            | IoError::MemLock { .. }
            | IoError::Alloc { .. }
            | IoError::Mbind { .. }
            | IoError::Setup { .. }
            | IoError::Enter { .. }
            | IoError::Sysfs { .. }
            | IoError::CpuList { .. } => ExitCode::Io,
        }
    }
}

impl IoError {
    /// The OS error behind this error, if there is one (for EIO vs ENOSPC decisions).
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            IoError::Open { source, .. }
            | IoError::Read { source, .. }
            | IoError::Alloc { source, .. }
            | IoError::Mbind { source, .. }
            | IoError::Setup { source, .. }
            | IoError::Enter { source, .. }
            | IoError::Sysfs { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::IoError;
    use crate::exit::{Classify, ExitCode};
    use std::path::PathBuf;

    #[test]
    fn memlock_message_says_what_to_do() {
        let e = IoError::MemLock { have: 8 << 20, need: 3_435_973_837 };
        assert_eq!(
            e.to_string(),
            "RLIMIT_MEMLOCK is 8 MiB; the buffers need 3.2 GiB, counted once for mlock and once more for io_uring: \
             raise it to twice that (`ulimit -l 6710887`, in KiB) or set LimitMEMLOCK=infinity"
        );
        assert_eq!(e.exit_code(), ExitCode::Io);
        assert_eq!(super::memlock_kib_advised(4 << 20), 8192);
        assert_eq!(super::memlock_kib_advised((4 << 20) + 1), 8193);
    }

    #[test]
    fn read_and_short_read_name_path_and_offset() {
        let e = IoError::Read {
            path: PathBuf::from("/nvme/k3/shard-00007.safetensors"),
            offset: 1_048_576,
            len: 4096,
            source: std::io::Error::from_raw_os_error(libc::EIO),
        };
        let text = e.to_string();
        assert!(text.starts_with("read of 4096 bytes at offset 1048576 of /nvme/k3/shard-00007.safetensors failed: "));
        assert_eq!(e.exit_code(), ExitCode::Io);
        assert_eq!(e.raw_os_error(), Some(libc::EIO));

        let e = IoError::ShortRead { path: PathBuf::from("/x/shard.bin"), offset: 8192, wanted: 4096, got: 100 };
        assert_eq!(
            e.to_string(),
            "/x/shard.bin ends early: a read at offset 8192 needs 4096 bytes but the file holds only 100; \
             the file is shorter than the checkpoint index says"
        );
        assert_eq!(e.exit_code(), ExitCode::Data);
    }

    #[test]
    fn malformed_ops_are_bugs_and_setup_failures_are_io() {
        let e = IoError::BadOp { tag: 7, why: "min_len 8192 > len 4096".into() };
        assert_eq!(e.exit_code(), ExitCode::Internal);
        let e = IoError::Unaligned { what: "offset".into(), value: 100, align: 4096 };
        assert_eq!(e.exit_code(), ExitCode::Internal);
        let e = IoError::QueueFull { tag: 9, queued: 64, max: 64 };
        assert_eq!(e.exit_code(), ExitCode::Internal);
        let e = IoError::Setup { what: "the I/O thread".into(), source: std::io::Error::other("it exited") };
        assert_eq!(e.exit_code(), ExitCode::Io);
    }
}
