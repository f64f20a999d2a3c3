//! The documented process exit codes (docs/USAGE.md "Exit codes") and [`Classify`], by which each error
//! type states its own code next to its definition.
//!
//! A leaf: it depends on nothing else in the crate, so every library module can implement
//! [`Classify`] without reaching up to the CLI. Only the CLI edge ([`crate::error::exit_code_for`])
//! turns a classification into a process status.
#![forbid(unsafe_code)]

/// Process exit codes, documented in docs/USAGE.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ExitCode {
    Ok = 0,
    /// A bug: an invariant failed, the engine built a wrong request, or an error has no better class.
    Internal = 1,
    /// Usage or config refused: a bad flag, a refused config, budget or memory.
    Usage = 2,
    /// Checkpoint or data invalid: a missing or misshaped tensor, a corrupt header or scale, a
    /// file shorter than its index says.
    Data = 3,
    /// I/O failure: a file that cannot be opened or read, a system resource that cannot be set up.
    Io = 4,
    /// Stopped by Ctrl-C (SIGINT) after printing the summary so far: 128 + SIGINT, as shells report.
    Interrupted = 130,
}

impl From<ExitCode> for u8 {
    fn from(code: ExitCode) -> u8 {
        code as u8
    }
}

impl From<ExitCode> for std::process::ExitCode {
    fn from(code: ExitCode) -> std::process::ExitCode {
        std::process::ExitCode::from(u8::from(code))
    }
}

/// An error that knows which exit code it ends the process with.
///
/// An error that wraps another delegates to the inner error's classification, so a failure keeps
/// its class however many layers it passes through.
pub trait Classify {
    fn exit_code(&self) -> ExitCode;
}

/// A bare OS error reaching the CLI is an I/O failure.
impl Classify for std::io::Error {
    fn exit_code(&self) -> ExitCode {
        ExitCode::Io
    }
}

#[cfg(test)]
mod tests {
    use super::{Classify, ExitCode};

    #[test]
    fn codes_are_the_documented_numbers() {
        let pairs = [
            (ExitCode::Ok, 0u8),
            (ExitCode::Internal, 1),
            (ExitCode::Usage, 2),
            (ExitCode::Data, 3),
            (ExitCode::Io, 4),
            (ExitCode::Interrupted, 130),
        ];
        for (code, n) in pairs {
            assert_eq!(u8::from(code), n, "{code:?}");
        }
    }

    #[test]
    fn io_error_is_io() {
        assert_eq!(std::io::Error::from_raw_os_error(libc::EIO).exit_code(), ExitCode::Io);
    }
}
