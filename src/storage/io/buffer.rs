//! [`AlignedBuf`]: one read buffer, made once at startup (house rule 13).
//!
//! Steps, in this order because each depends on the previous: map anonymous memory with 2 MiB
//! of slack; trim it to a 2 MiB-aligned, 2 MiB-multiple range (so THP can back it and every DIO
//! alignment divides it); `madvise(MADV_HUGEPAGE)`; `mbind` to the NUMA node *before any page is
//! touched* (a touched page stays where it was first faulted); `mlock` if asked; write one byte
//! per 4 KiB page so no page fault is left for the per-token path. Runs on the thread that builds
//! the arena; the first touch happens there, which is why the node policy must come first.
//!
//! With the `hwloc` cargo feature the binding goes through hwloc (`hwloc_set_area_membind` with
//! the node's nodeset) on a topology of this machine loaded once per process; if hwloc cannot
//! load one, the raw `mbind` below is used, as in the default build.

use std::ptr::NonNull;

use super::error::IoError;

/// Alignment and size granule of every buffer: one x86-64 transparent huge page.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Stride of the pre-fault loop: the base page size.
const PAGE_BYTES: usize = 4096;

/// Highest NUMA node id `mbind` is given (the node mask is this many bits).
pub const NUMA_NODE_MAX: u32 = 1023;

/// How strictly a buffer keeps to its node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NumaPolicy {
    /// `MPOL_BIND`: pages come only from the node (allocation fails rather than spill).
    #[default]
    Bind,
    /// `MPOL_PREFERRED`: the node first, another when it is full.
    Preferred,
}

/// How to make a buffer. Passed explicitly; `Default` is unlocked, unbound, huge pages on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufOptions {
    /// NUMA node to place the pages on; None leaves the kernel's default (first touch).
    pub node: Option<u32>,
    /// Bind or prefer, when `node` is set.
    pub policy: NumaPolicy,
    /// Try to `mlock` the buffer. Failure is not fatal: the buffer stays unlocked and
    /// [`AlignedBuf::lock_state`] says why; callers that need pinning check it (house rule 13).
    pub lock: bool,
    /// `madvise(MADV_HUGEPAGE)`, so THP backs the buffer with 2 MiB pages (fewer TLB misses).
    pub huge_pages: bool,
}

impl Default for BufOptions {
    fn default() -> BufOptions {
        BufOptions { node: None, policy: NumaPolicy::Bind, lock: false, huge_pages: true }
    }
}

/// Whether a buffer is locked in RAM.
#[derive(Debug)]
pub enum LockState {
    /// `mlock` succeeded.
    Locked,
    /// The options did not ask for it.
    NotRequested,
    /// `mlock` failed; [`IoError::MemLock`] when RLIMIT_MEMLOCK was too low, else
    /// [`IoError::Setup`] with the errno.
    Failed(IoError),
}

/// A 2 MiB-aligned anonymous mapping used as a DMA target for O_DIRECT reads.
#[derive(Debug)]
pub struct AlignedBuf {
    /// Start of the mapping; 2 MiB aligned.
    ptr: NonNull<u8>,
    /// Bytes asked for.
    len: usize,
    /// Bytes mapped: `len` rounded up to [`HUGE_PAGE_BYTES`].
    map_len: usize,
    lock: LockState,
    node: Option<u32>,
}

// SAFETY: an `AlignedBuf` exclusively owns its mapping (no other handle to it exists), so moving
// it to another thread moves that ownership; the mapping is process-wide memory with no thread
// affinity (mbind is a property of the pages, not the thread).
unsafe impl Send for AlignedBuf {}
// SAFETY: through `&AlignedBuf` safe code can only read (`as_slice`); writing needs `&mut self`
// or a raw pointer used under an `unsafe` contract (the readers' `submit`), which forbids any
// reference to the range while the kernel writes it. Concurrent reads of plain bytes are fine.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Maps, places, locks and pre-faults a buffer of at least `len` bytes.
    pub fn new(len: usize, opts: &BufOptions) -> Result<AlignedBuf, IoError> {
        let map_len = len.max(1).div_ceil(HUGE_PAGE_BYTES).checked_mul(HUGE_PAGE_BYTES);
        let Some(map_len) = map_len else {
            return Err(alloc_error(len, std::io::Error::from_raw_os_error(libc::ENOMEM)));
        };
        let ptr = map_aligned(map_len)?;
        let mut buf = AlignedBuf { ptr, len, map_len, lock: LockState::NotRequested, node: None };
        if opts.huge_pages {
            buf.advise_huge_pages();
        }
        if let Some(node) = opts.node {
            // On failure `buf` drops here and unmaps.
            #[cfg(feature = "hwloc")]
            hwloc_bind::bind_to_node(buf.ptr, buf.map_len, node, opts.policy)?;
            #[cfg(not(feature = "hwloc"))]
            bind_to_node(buf.ptr, buf.map_len, node, opts.policy)?;
            buf.node = Some(node);
        }
        if opts.lock {
            buf.lock = lock(buf.ptr, buf.map_len);
        }
        buf.prefault();
        assert_eq!(buf.ptr.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        assert!(buf.map_len >= buf.len);
        Ok(buf)
    }

    fn advise_huge_pages(&self) {
        // SAFETY: the range is exactly the mapping this buffer owns; MADV_HUGEPAGE only changes
        // how the kernel backs it, never its contents.
        let rc = unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.map_len, libc::MADV_HUGEPAGE) };
        if rc != 0 {
            // THP disabled or not built in: 4 KiB pages work, only with more TLB misses.
            tracing::debug!(error = %std::io::Error::last_os_error(), "madvise(MADV_HUGEPAGE) refused");
        }
    }

    /// Writes one zero byte per base page so every page is faulted in now, on this thread (and
    /// so on the bound node), rather than on the first read into it.
    fn prefault(&mut self) {
        let base = self.ptr.as_ptr();
        for offset in (0..self.map_len).step_by(PAGE_BYTES) {
            // SAFETY: `offset < map_len`, so the byte is inside the mapping this buffer owns, and
            // nothing else references it yet. Volatile so the store is not elided.
            unsafe { base.add(offset).write_volatile(0) };
        }
    }

    /// Bytes asked for (the usable length of the slices).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes mapped (`len` rounded up to 2 MiB); what locking and registration account for.
    pub fn mapped_len(&self) -> usize {
        self.map_len
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is inside the live mapping, initialised (pre-faulted zero pages
        // or bytes read into it), and `&self` guarantees no `&mut` slice exists. A raw-pointer
        // writer (a read in flight) is excluded by the readers' `submit` contract.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Start of the buffer, for address arithmetic and reads.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the buffer as a DMA target for a reader's `submit`. Writing through it while a
    /// slice from [`AlignedBuf::as_slice`] is in use is undefined behaviour; the `submit`
    /// contract is what makes that the caller's promise.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whether `mlock` succeeded.
    pub fn is_locked(&self) -> bool {
        matches!(self.lock, LockState::Locked)
    }

    /// Whether the buffer is locked, and if not, why.
    pub fn lock_state(&self) -> &LockState {
        &self.lock
    }

    /// The NUMA node the buffer is bound to, if one was asked for.
    pub fn node(&self) -> Option<u32> {
        self.node
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+map_len` is exactly the mapping made in `new` and owned by this value;
        // `&mut self` in drop means no slice of it is alive. Unmapping also unlocks it.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
        debug_assert_eq!(rc, 0, "munmap of an owned mapping failed");
    }
}

fn alloc_error(len: usize, source: std::io::Error) -> IoError {
    IoError::Alloc { bytes: len as u64, source }
}

/// Maps `map_len + 2 MiB` bytes and unmaps the head and tail so a 2 MiB-aligned `map_len` range
/// remains.
fn map_aligned(map_len: usize) -> Result<NonNull<u8>, IoError> {
    let Some(total) = map_len.checked_add(HUGE_PAGE_BYTES) else {
        return Err(alloc_error(map_len, std::io::Error::from_raw_os_error(libc::ENOMEM)));
    };
    // SAFETY: a fresh private anonymous mapping at an address of the kernel's choosing touches
    // no existing memory.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(alloc_error(map_len, std::io::Error::last_os_error()));
    }
    let base = raw as usize;
    let start = base.next_multiple_of(HUGE_PAGE_BYTES);
    let head = start - base;
    let tail = total - head - map_len;
    assert!(head <= HUGE_PAGE_BYTES);
    assert!(tail <= HUGE_PAGE_BYTES);
    assert_eq!(head + map_len + tail, total);
    // SAFETY: both ranges lie inside the mapping just made, outside the kept range, and are
    // page-aligned (mmap returns a page-aligned base; `start` and `map_len` are 2 MiB multiples).
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((start + map_len) as *mut libc::c_void, tail);
        }
    }
    match NonNull::new(start as *mut u8) {
        Some(ptr) => Ok(ptr),
        None => Err(alloc_error(map_len, std::io::Error::from_raw_os_error(libc::ENOMEM))),
    }
}

/// `mbind(ptr, len, MPOL_BIND or MPOL_PREFERRED, {node})` via the raw syscall (glibc has no
/// wrapper; libnuma is not a dependency).
fn bind_to_node(ptr: NonNull<u8>, len: usize, node: u32, policy: NumaPolicy) -> Result<(), IoError> {
    let bind_error = |source| IoError::Mbind { node, bytes: len as u64, source };
    if node > NUMA_NODE_MAX {
        return Err(bind_error(std::io::Error::from_raw_os_error(libc::EINVAL)));
    }
    const MASK_WORDS: usize = (NUMA_NODE_MAX as usize + 1) / 64;
    let mut mask = [0u64; MASK_WORDS];
    mask[node as usize / 64] |= 1u64 << (node % 64);
    let mode = match policy {
        NumaPolicy::Bind => libc::MPOL_BIND,
        NumaPolicy::Preferred => libc::MPOL_PREFERRED,
    };
    // The kernel reads `maxnode - 1` bits (a historical off-by-one libnuma also compensates for).
    let maxnode = (MASK_WORDS * 64 + 1) as libc::c_ulong;
    // SAFETY: `ptr..ptr+len` is a mapping owned by the caller and not yet touched; `mask` is a
    // live array of `MASK_WORDS * 64` bits, which covers `maxnode - 1`; flags 0 moves no pages.
    let rc = unsafe { libc::syscall(libc::SYS_mbind, ptr.as_ptr(), len, mode, mask.as_ptr(), maxnode, 0u32) };
    if rc != 0 {
        let source = std::io::Error::last_os_error();
        // A kernel without NUMA support has one node; binding to node 0 is then a no-op.
        if source.raw_os_error() == Some(libc::ENOSYS) && node == 0 {
            return Ok(());
        }
        return Err(bind_error(source));
    }
    Ok(())
}

/// Memory binding through hwloc, for the `hwloc` feature.
#[cfg(feature = "hwloc")]
mod hwloc_bind {
    use std::ptr::NonNull;
    use std::sync::OnceLock;

    use hwlocality::memory::binding::{MemoryBindingError, MemoryBindingFlags, MemoryBindingPolicy};
    use hwlocality::memory::nodeset::NodeSet;
    use hwlocality::object::types::ObjectType;
    use hwlocality::Topology;

    use super::{IoError, NumaPolicy};

    /// This machine's hwloc topology, loaded on first use (tens of milliseconds) and kept for the
    /// process; None when hwloc could not load it.
    pub(super) fn this_machine() -> Option<&'static Topology> {
        static TOPOLOGY: OnceLock<Option<Topology>> = OnceLock::new();
        let topology = TOPOLOGY.get_or_init(|| match Topology::new() {
            Ok(topology) => Some(topology),
            Err(e) => {
                tracing::warn!("hwloc cannot load this machine's topology, binding buffers with mbind: {e}");
                None
            }
        });
        topology.as_ref()
    }

    /// Binds `ptr..ptr+len` to NUMA node `node` (its OS index). hwloc's `Bind` policy is
    /// `MPOL_BIND` on Linux only with the STRICT flag, and `MPOL_PREFERRED` (or
    /// `MPOL_PREFERRED_MANY`) without it, so STRICT is what tells our two policies apart.
    pub(super) fn bind_to_node(ptr: NonNull<u8>, len: usize, node: u32, policy: NumaPolicy) -> Result<(), IoError> {
        let Some(topology) = this_machine() else {
            return super::bind_to_node(ptr, len, node, policy);
        };
        let bind_error = |source| IoError::Mbind { node, bytes: len as u64, source };
        let numa = topology.objects_with_type(ObjectType::NUMANode).find(|obj| obj.os_index() == Some(node as usize));
        let Some(nodeset) = numa.and_then(|obj| obj.nodeset()) else {
            // The same errno mbind gives for a node that does not exist.
            return Err(bind_error(std::io::Error::from_raw_os_error(libc::EINVAL)));
        };
        let flags = match policy {
            NumaPolicy::Bind => MemoryBindingFlags::STRICT,
            NumaPolicy::Preferred => MemoryBindingFlags::empty(),
        };
        // SAFETY: `ptr..ptr+len` is a live, readable (PROT_READ|PROT_WRITE) anonymous mapping
        // owned by the caller, whose bytes read as zero, and no `&mut` to it exists while this
        // slice lives (until the end of this function). hwloc only passes its address and
        // length to mbind and never reads or writes the bytes, so no page is touched here.
        let area = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len) };
        match topology.bind_memory_area(area, nodeset, MemoryBindingPolicy::Bind, flags) {
            Ok(()) => Ok(()),
            // A kernel without NUMA support has one node; binding to node 0 is then a no-op.
            Err(hwlocality::errors::HybridError::Rust(MemoryBindingError::Unsupported)) if node == 0 => Ok(()),
            Err(e) => Err(bind_error(to_io_error(e))),
        }
    }

    fn to_io_error(e: hwlocality::errors::HybridError<MemoryBindingError<NodeSet>>) -> std::io::Error {
        match e {
            hwlocality::errors::HybridError::Hwloc(raw) => match raw.errno {
                Some(errno) => std::io::Error::from_raw_os_error(errno.0),
                None => std::io::Error::other(raw.to_string()),
            },
            hwlocality::errors::HybridError::Rust(e) => std::io::Error::other(format!("hwloc: {e}")),
        }
    }
}

/// `RLIMIT_MEMLOCK` soft limit in bytes; None when unlimited.
pub fn memlock_limit() -> Option<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a live, writable rlimit struct.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(lim.rlim_cur)
}

/// Fails with [`IoError::MemLock`] when `need` bytes (plus what this process has locked
/// already) exceed `limit`. For callers that refuse to start unpinned (house rule 13). Note that
/// a process with CAP_IPC_LOCK (root) may lock past the limit, so [`AlignedBuf::new`] tries
/// `mlock` even when this check fails.
pub fn check_memlock(limit: Option<u64>, locked_already: u64, need: u64) -> Result<(), IoError> {
    match limit {
        Some(have) if locked_already.saturating_add(need) > have => {
            Err(IoError::MemLock { have, need: locked_already.saturating_add(need) })
        }
        _ => Ok(()),
    }
}

/// Bytes this process has locked (`VmLck` of /proc/self/status); 0 when unknown.
pub fn locked_bytes() -> u64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return 0 };
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmLck:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

fn lock(ptr: NonNull<u8>, len: usize) -> LockState {
    let precheck = check_memlock(memlock_limit(), locked_bytes(), len as u64);
    // SAFETY: `ptr..ptr+len` is a mapping owned by the caller; mlock changes residency only.
    let rc = unsafe { libc::mlock(ptr.as_ptr().cast(), len) };
    if rc == 0 {
        return LockState::Locked;
    }
    let source = std::io::Error::last_os_error();
    let reason = match precheck {
        Err(memlock) => memlock,
        Ok(()) => IoError::Setup { what: format!("mlock of {} bytes", len), source },
    };
    tracing::warn!("read buffers stay unlocked: {reason}");
    LockState::Failed(reason)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn buffers_can_be_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<AlignedBuf>();
    }

    #[test]
    fn pointer_is_2mib_aligned_and_length_rounded() {
        let buf = AlignedBuf::new(3 << 20, &BufOptions::default()).unwrap();
        assert_eq!(buf.as_ptr() as usize % HUGE_PAGE_BYTES, 0);
        assert_eq!(buf.len(), 3 << 20);
        assert_eq!(buf.mapped_len(), 4 << 20);
        assert!(buf.as_slice().iter().all(|&b| b == 0));
        assert!(matches!(buf.lock_state(), LockState::NotRequested));
        assert!(!buf.is_locked());
    }

    #[test]
    fn contents_read_back_what_was_written() {
        let mut buf = AlignedBuf::new(5000, &BufOptions { huge_pages: false, ..BufOptions::default() }).unwrap();
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        assert!(buf.as_slice().iter().enumerate().all(|(i, &b)| b == (i % 253) as u8));
        assert_eq!(buf.as_slice().len(), 5000);
    }

    #[test]
    fn lock_is_reported() {
        let buf = AlignedBuf::new(4 << 20, &BufOptions { lock: true, ..BufOptions::default() }).unwrap();
        match buf.lock_state() {
            LockState::Locked => assert!(buf.is_locked()),
            LockState::Failed(e) => {
                assert!(!buf.is_locked());
                assert!(matches!(e, IoError::MemLock { .. } | IoError::Setup { .. }), "{e}");
            }
            LockState::NotRequested => panic!("lock was requested"),
        }
    }

    #[test]
    fn binds_to_node_zero_and_refuses_a_missing_node() {
        let buf = AlignedBuf::new(2 << 20, &BufOptions { node: Some(0), ..BufOptions::default() }).unwrap();
        assert_eq!(buf.node(), Some(0));
        let missing = NUMA_NODE_MAX;
        let err = AlignedBuf::new(2 << 20, &BufOptions { node: Some(missing), ..BufOptions::default() }).unwrap_err();
        assert!(matches!(err, IoError::Mbind { node, .. } if node == missing), "{err}");
        assert!(err.to_string().contains("NUMA node 1023"), "{err}");
    }

    #[test]
    fn memlock_check_with_a_fake_limit() {
        let err = check_memlock(Some(8 << 20), 0, 3_435_973_837).unwrap_err();
        assert_eq!(
            err.to_string(),
            "RLIMIT_MEMLOCK is 8 MiB; the buffers need 3.2 GiB, counted once for mlock and once more for io_uring: \
             raise it to twice that (`ulimit -l 6710887`, in KiB) or set LimitMEMLOCK=infinity"
        );
        assert!(check_memlock(None, 0, u64::MAX).is_ok());
        assert!(check_memlock(Some(8 << 20), 4 << 20, 4 << 20).is_ok());
        assert!(check_memlock(Some(8 << 20), 4 << 20, (4 << 20) + 1).is_err());
    }
}

#[cfg(all(test, feature = "hwloc"))]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod hwloc_tests {
    use hwlocality::memory::binding::{MemoryBindingFlags, MemoryBindingPolicy};
    use hwlocality::memory::nodeset::NodeSet;

    use super::*;

    /// `MPOL_F_ADDR` and `MPOL_PREFERRED_MANY` of `<linux/mempolicy.h>`; libc lacks them.
    const MPOL_F_ADDR: libc::c_ulong = 1 << 1;
    const MPOL_PREFERRED_MANY: libc::c_int = 5;

    /// The kernel's policy mode for the mapping holding `addr` (`get_mempolicy(MPOL_F_ADDR)`).
    fn kernel_policy(addr: *const u8) -> libc::c_int {
        let mut mode: libc::c_int = -1;
        // SAFETY: `mode` is a live, writable int; a null node mask with maxnode 0 asks for the
        // mode only; `addr` is only looked up in this process's mappings, never dereferenced.
        let rc = unsafe {
            let no_mask = std::ptr::null_mut::<libc::c_ulong>();
            libc::syscall(libc::SYS_get_mempolicy, &mut mode, no_mask, 0 as libc::c_ulong, addr, MPOL_F_ADDR)
        };
        assert_eq!(rc, 0, "get_mempolicy: {}", std::io::Error::last_os_error());
        mode
    }

    fn nodes(set: &NodeSet) -> Vec<usize> {
        set.iter_set().map(usize::from).collect()
    }

    #[test]
    fn a_buffer_bound_through_hwloc_reports_its_node() {
        let topology = hwloc_bind::this_machine().expect("hwloc loads this machine's topology");
        let cases = [
            (NumaPolicy::Bind, &[libc::MPOL_BIND][..]),
            (NumaPolicy::Preferred, &[libc::MPOL_PREFERRED, MPOL_PREFERRED_MANY][..]),
        ];
        for (policy, kernel_modes) in cases {
            let buf = AlignedBuf::new(4 << 20, &BufOptions { node: Some(0), policy, ..BufOptions::default() }).unwrap();
            assert_eq!(buf.node(), Some(0));
            let (bound, hwloc_policy) =
                topology.area_memory_binding::<[u8], NodeSet>(buf.as_slice(), MemoryBindingFlags::empty()).unwrap();
            assert_eq!(nodes(&bound), vec![0], "{policy:?}");
            assert_eq!(hwloc_policy, Some(MemoryBindingPolicy::Bind), "{policy:?}");
            // The buffer is pre-faulted, so its pages are resident, and on node 0.
            let resident: NodeSet = topology.area_memory_location(buf.as_slice(), MemoryBindingFlags::empty()).unwrap();
            assert_eq!(nodes(&resident), vec![0], "{policy:?}");
            let mode = kernel_policy(buf.as_ptr());
            assert!(kernel_modes.contains(&mode), "{policy:?} gave kernel mode {mode}");
        }
    }

    #[test]
    fn hwloc_refuses_a_missing_node_with_the_mbind_error() {
        if hwloc_bind::this_machine().unwrap().nodeset().iter_set().any(|n| usize::from(n) == 7) {
            return; // This machine has a node 7; the test below covers node 1023.
        }
        let err = AlignedBuf::new(2 << 20, &BufOptions { node: Some(7), ..BufOptions::default() }).unwrap_err();
        assert!(matches!(err, IoError::Mbind { node: 7, .. }), "{err}");
        assert!(err.to_string().contains("to NUMA node 7: Invalid argument (os error 22)"), "{err}");
    }
}
