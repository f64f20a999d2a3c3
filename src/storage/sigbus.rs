//! Memory-mapped files whose read faults end the process with exit 4 and a message naming the
//! file and the offset, instead of a bare "Bus error".
//!
//! A read of a mapped page fails as SIGBUS, not as an error return: on a disk error (EIO) under
//! the page cache, or when the file shrank while mapped. Every [`MappedFile`] registers its
//! address range with a message preformatted at map time in a fixed table; the handler
//! ([`install_handler`], installed once by the CLI) looks the faulting address up there, writes
//! the message with write(2) and calls `_exit(4)`. The handler only reads atomics and calls
//! async-signal-safe functions: no allocation, no lock, no `fmt`. A SIGBUS outside every
//! registered range (or sent by another process) restores the default action and recurs, so it
//! kills the process with SIGBUS as before.
//!
//! Mapping stays zero-copy: the resident store hands out borrows of the mappings, and the cost is
//! one table entry per mapped file. Documented in docs/STORAGE.md ("Faults under mapped weights").

use std::fs::File;
use std::ops::Deref;
use std::path::Path;
use std::sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Mutex;

use memmap2::Mmap;

/// Mapped files that can be registered at once (the release maps 96 shards plus the pack, once
/// per open store); a mapping beyond this still works, but a fault in it is a bare SIGBUS.
const SLOTS: usize = 1024;

/// The exit code of a fault in a registered mapping: an I/O failure (`crate::exit::ExitCode::Io`).
const EXIT_IO: libc::c_int = 4;

/// One registered mapping. Written under [`WRITER`]; read by the handler without a lock through
/// the sequence number: odd while the slot is being rewritten, and a reader that sees it change
/// (or odd) ignores what it read.
struct Slot {
    seq: AtomicUsize,
    start: AtomicUsize,
    /// 0 when the slot is free.
    len: AtomicUsize,
    message: AtomicPtr<u8>,
    message_len: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)] // the template of each table entry, copied once
const FREE: Slot = Slot {
    seq: AtomicUsize::new(0),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    message: AtomicPtr::new(std::ptr::null_mut()),
    message_len: AtomicUsize::new(0),
};

static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
/// Serialises registration and removal (never taken by the handler).
static WRITER: Mutex<()> = Mutex::new(());
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The whole preformatted message with a marker byte (0) where the handler writes the offset.
fn preformat(path: &Path) -> Box<[u8]> {
    let mut m = b"k3ring: error: read at offset \0 of ".to_vec();
    m.extend_from_slice(path.as_os_str().as_encoded_bytes());
    m.extend_from_slice(
        b" failed: SIGBUS on the memory-mapped file (a disk error, or the file shrank while k3ring ran)\n",
    );
    m.into_boxed_slice()
}

/// A registered range; removed from the table when dropped.
struct Registration(Option<usize>);

impl Registration {
    fn new(start: usize, len: usize, path: &Path) -> Registration {
        if len == 0 {
            return Registration(None);
        }
        let message = preformat(path);
        let _guard = WRITER.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(i) = TABLE.iter().position(|s| s.len.load(Ordering::Relaxed) == 0) else {
            tracing::warn!(
                "more than {SLOTS} files mapped: a read fault in {} would end k3ring with a bare SIGBUS",
                path.display()
            );
            return Registration(None);
        };
        let slot = &TABLE[i];
        let message_len = message.len();
        let message = Box::into_raw(message).cast::<u8>();
        slot.seq.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        slot.start.store(start, Ordering::Relaxed);
        slot.message.store(message, Ordering::Relaxed);
        slot.message_len.store(message_len, Ordering::Relaxed);
        slot.len.store(len, Ordering::Relaxed);
        slot.seq.fetch_add(1, Ordering::Release);
        Registration(Some(i))
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let Some(i) = self.0 else { return };
        let slot = &TABLE[i];
        let (message, message_len) = {
            let _guard = WRITER.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            slot.seq.fetch_add(1, Ordering::Relaxed);
            fence(Ordering::Release);
            slot.len.store(0, Ordering::Relaxed);
            slot.start.store(0, Ordering::Relaxed);
            let message = slot.message.swap(std::ptr::null_mut(), Ordering::Relaxed);
            let message_len = slot.message_len.swap(0, Ordering::Relaxed);
            slot.seq.fetch_add(1, Ordering::Release);
            (message, message_len)
        };
        if !message.is_null() {
            // SAFETY: `message` and `message_len` are the pointer and length of the boxed slice
            // leaked in `Registration::new` for this slot, taken out of the table above exactly
            // once. The handler reads a slot's message only while the faulting thread accesses
            // that slot's mapping, and the mapping (which owns this registration) cannot be
            // dropped while it is borrowed.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(message, message_len)) });
        }
    }
}

/// The message and file offset of the registered mapping holding `addr`, if any. Lock-free and
/// allocation-free: called from the signal handler.
fn lookup(addr: usize) -> Option<(&'static [u8], usize)> {
    for slot in &TABLE {
        let before = slot.seq.load(Ordering::Acquire);
        if before % 2 == 1 {
            continue;
        }
        let start = slot.start.load(Ordering::Relaxed);
        let len = slot.len.load(Ordering::Relaxed);
        let message = slot.message.load(Ordering::Relaxed);
        let message_len = slot.message_len.load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        if slot.seq.load(Ordering::Relaxed) != before || len == 0 || message.is_null() {
            continue;
        }
        if addr >= start && addr - start < len {
            // SAFETY: the sequence number did not change, so these are the pointer and length
            // stored together by one registration, and its message stays allocated while its
            // mapping is accessed (see `Registration::drop`); the fault at `addr` is such an
            // access.
            let message = unsafe { std::slice::from_raw_parts(message, message_len) };
            return Some((message, addr - start));
        }
    }
    None
}

/// write(2) of all of `bytes` to stderr, ignoring failures (nothing else can be done).
fn write_stderr(mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: the pointer and length describe the live slice `bytes`; write(2) is
        // async-signal-safe.
        let n = unsafe { libc::write(libc::STDERR_FILENO, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

/// The decimal digits of `n` at the end of `buf`, without `fmt` (which the handler must not use).
fn decimal(mut n: usize, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// Writes `message` with `offset` in place of its 0 marker.
fn write_message(message: &[u8], offset: usize) {
    let mut digits = [0u8; 20];
    match message.iter().position(|&b| b == 0) {
        Some(at) => {
            write_stderr(&message[..at]);
            write_stderr(decimal(offset, &mut digits));
            write_stderr(&message[at + 1..]);
        }
        None => write_stderr(message),
    }
}

extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    // SAFETY: the kernel hands an SA_SIGINFO handler a valid siginfo_t; si_addr is meaningful
    // for the kernel's own SIGBUS (si_code > 0), the only case it is used.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code > 0 {
        if let Some((message, offset)) = lookup(addr) {
            write_message(message, offset);
            // SAFETY: _exit is async-signal-safe and ends the process without running anything
            // of this one (no destructors, no atexit handlers, no stdio flush).
            unsafe { libc::_exit(EXIT_IO) };
        }
    }
    // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask; sigaction is async-signal-safe.
    unsafe {
        let default: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, &default, std::ptr::null_mut());
    }
    if code <= 0 {
        // Sent by a process: returning would not repeat it, so it is raised again, delivered with
        // the default action once this handler returns. A kernel fault repeats by itself when
        // the faulting instruction runs again.
        // SAFETY: raise is async-signal-safe.
        unsafe { libc::raise(signal) };
    }
}

/// Installs the SIGBUS handler (once per process; later calls do nothing). The CLI installs it
/// at start-up; a library user who wants the same behaviour calls it too.
pub fn install_handler() -> std::io::Result<()> {
    if INSTALLED.swap(true, Ordering::AcqRel) {
        return Ok(());
    }
    // SAFETY: a zeroed sigaction is a valid "no handler, empty mask, no flags" value; every
    // field that matters is then set explicitly.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_sigbus as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize;
    // SA_ONSTACK: a fault on a thread whose stack is exhausted still gets a stack to run on.
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: `action.sa_mask` is a valid sigset_t to clear.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    // SAFETY: `action` is fully initialised and names a handler that only does what an
    // async-signal handler may (see `on_sigbus`).
    if unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) } != 0 {
        INSTALLED.store(false, Ordering::Release);
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A whole file mapped read-only and registered for [`install_handler`]'s messages.
pub struct MappedFile {
    // Field order: the registration goes before the mapping is unmapped.
    _registration: Registration,
    map: Mmap,
}

impl MappedFile {
    /// Maps `file` (opened from `path`, which the fault message names).
    pub fn map(file: &File, path: &Path) -> std::io::Result<MappedFile> {
        // SAFETY: a read-only private mapping; k3ring never writes it. If the file shrinks or the
        // disk fails under it, a read faults (SIGBUS), which the registration below turns into
        // exit 4 naming the file once the handler is installed, instead of undefined behaviour
        // being observed: the faulting read never returns.
        let map = unsafe { Mmap::map(file) }?;
        let registration = Registration::new(map.as_ptr() as usize, map.len(), path);
        Ok(MappedFile { _registration: registration, map })
    }
}

impl Deref for MappedFile {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn decimal_digits() {
        let mut buf = [0u8; 20];
        assert_eq!(decimal(0, &mut buf), b"0");
        assert_eq!(decimal(4096, &mut buf), b"4096");
        assert_eq!(decimal(usize::MAX, &mut buf), usize::MAX.to_string().as_bytes());
    }

    #[test]
    fn a_mapping_is_found_by_address_until_dropped() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("shard.safetensors");
        std::fs::write(&path, vec![7u8; 10_000]).unwrap();
        let file = File::open(&path).unwrap();
        let map = MappedFile::map(&file, &path).unwrap();
        let base = map.as_ptr() as usize;
        let (message, offset) = lookup(base + 4097).unwrap();
        assert_eq!(offset, 4097);
        let text = String::from_utf8_lossy(message).into_owned();
        assert!(text.starts_with("k3ring: error: read at offset \0 of "), "{text}");
        assert!(text.contains(path.to_str().unwrap()), "{text}");
        assert!(lookup(base + 10_000).is_none(), "one past the end is outside");
        drop(map);
        // Another test's mapping may take the freed addresses, but not this file's message.
        let named = |m: &[u8]| String::from_utf8_lossy(m).contains(path.to_str().unwrap());
        assert!(!lookup(base + 4097).is_some_and(|(m, _)| named(m)), "a dropped mapping is no longer registered");
    }
}
