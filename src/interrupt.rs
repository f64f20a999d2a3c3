//! Ctrl-C (SIGINT): the first one sets a flag that generation checks between prefill chunks and
//! between tokens, so a run stops cleanly and prints what it did so far (exit 130, like a shell's
//! 128 + SIGINT); a second one ends the process at once, also with 130, for a run stuck before
//! the next check (opening a large model, one long chunk).

use std::sync::atomic::{AtomicBool, Ordering};

use crate::exit::{Classify, ExitCode};

/// Set by the SIGINT handler; cleared only by [`clear`] (the chat, after a stopped reply).
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The flag the handler sets, for [`crate::engine::GenerateOptions::stop`].
pub fn flag() -> &'static AtomicBool {
    &INTERRUPTED
}

/// Forgets a Ctrl-C that was handled (the chat's reply stopped and the prompt is back), so the
/// next one stops the next reply instead of ending the process.
pub fn clear() {
    INTERRUPTED.store(false, Ordering::Relaxed);
}

/// Whether Ctrl-C was pressed since [`install_sigint_handler`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

extern "C" fn on_sigint(_signal: libc::c_int) {
    // Only async-signal-safe work here: an atomic swap, and `_exit` on the second signal.
    if INTERRUPTED.swap(true, Ordering::Relaxed) {
        // SAFETY: `_exit` is async-signal-safe and takes no pointers; skipping destructors and
        // buffered output is what a second Ctrl-C asks for.
        unsafe { libc::_exit(i32::from(u8::from(ExitCode::Interrupted))) };
    }
}

/// Installs the handler (with `SA_RESTART`, so system calls in flight resume rather than fail
/// with EINTR).
pub fn install_sigint_handler() -> std::io::Result<()> {
    // SAFETY: a zeroed `sigaction` is a valid empty value (no flags, empty mask, no handler)
    // that is filled in below before use.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_sigint as extern "C" fn(libc::c_int) as libc::sighandler_t;
    action.sa_flags = libc::SA_RESTART;
    // SAFETY: `sa_mask` is a valid, owned sigset_t.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    // SAFETY: `action` is fully initialised, the handler only touches an atomic (and `_exit`),
    // and a null old-action pointer is allowed.
    let rc = unsafe { libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A run stopped by Ctrl-C after printing its summary (exit 130).
#[derive(Debug, thiserror::Error)]
#[error("interrupted (Ctrl-C) after {prompt_done} of {prompt} prompt tokens and {generated} generated tokens; the summary above covers the run so far")]
pub struct Interrupted {
    pub prompt_done: usize,
    pub prompt: usize,
    pub generated: usize,
}

impl Classify for Interrupted {
    fn exit_code(&self) -> ExitCode {
        ExitCode::Interrupted
    }
}

/// A batch stopped by Ctrl-C: exit 130 after the summary of the requests done so far.
#[derive(Debug, thiserror::Error)]
#[error("interrupted (Ctrl-C) after {done} of {total} requests; their records are in --output and the summary above covers the run so far")]
pub struct InterruptedBatch {
    pub done: usize,
    pub total: usize,
}

impl Classify for InterruptedBatch {
    fn exit_code(&self) -> ExitCode {
        ExitCode::Interrupted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interrupted_is_exit_130_and_says_how_far_it_got() {
        let e = Interrupted { prompt_done: 64, prompt: 64, generated: 7 };
        assert_eq!(u8::from(e.exit_code()), 130);
        assert!(e.to_string().contains("64 of 64 prompt tokens and 7 generated"), "{e}");
    }
}
