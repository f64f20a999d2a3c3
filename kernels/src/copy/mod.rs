//! Copies of large byte ranges with non-temporal stores: what stands in for a drive's DMA when
//! reads are modeled (`--io sim:...`), where the destination is a read buffer the compute threads
//! take up later, not a range this core reads next.
//!
//! A plain copy (`memcpy`, which keeps regular stores up to copies of about the size of the last
//! level cache) reads every destination line before it writes it: three streams through memory
//! for two of data. The streaming stores write whole lines straight to memory. On one thread of
//! an Intel Xeon VM (Emerald Rapids), pieces of 1 MiB and 17.5 MB copied at 6.0-6.7 GB/s with
//! `memcpy` and 9.6-9.8 GB/s with 512-bit streaming stores (8.7-9.4 with 256-bit ones;
//! docs/BENCHMARKS.md, "Streaming copies for modeled drives"). What the plain copy gave besides
//! (the copied bytes left in a large L3, which the compute threads read next, as a Xeon's DDIO
//! leaves a real drive's DMA) the streaming copy gives up; the modeled cells measured there were
//! faster all the same. Not measured on AMD hosts, where `memcpy` already ran 14-18 GB/s.
//!
//! The bytes are the copy's whatever the ISA (twin tests); only the path they take differs. The
//! ISA is the host's best ([`Isa::best`], not `--isa`: a copy's bytes cannot differ). The
//! streaming loops end with a store fence, so the copy is ordered before whatever the caller
//! stores next (the completion another thread waits for).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

use std::sync::OnceLock;

use crate::isa::Isa;

/// The streaming loops' alignment of the destination (a cache line), and their step.
pub(crate) const LINE: usize = 64;
pub(crate) const STEP: usize = 4 * LINE;

/// `(dst, src, len)`: copies `len` bytes, `len` a multiple of [`STEP`] and `dst` aligned to
/// [`LINE`], with streaming stores, then fences them.
pub(crate) type StreamFn = unsafe fn(*mut u8, *const u8, usize);

/// The streaming loop of one ISA (none: a plain copy). Built only by [`Fns::for_isa`], so
/// `stream` is `Some` only for an ISA this host has.
#[derive(Clone, Copy)]
pub(crate) struct Fns {
    stream: Option<StreamFn>,
}

impl Fns {
    /// # Safety
    /// `isa` must be available on this host ([`Isa::is_available`]).
    pub(crate) unsafe fn for_isa(isa: Isa) -> Fns {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Fns { stream: Some(avx512::stream) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Fns { stream: Some(avx2::stream) },
            _ => Fns { stream: None },
        }
    }

    /// The loop of the best ISA this host has, chosen once per process.
    fn best() -> Fns {
        static BEST: OnceLock<Fns> = OnceLock::new();
        // SAFETY: Isa::best only returns ISAs this host can run.
        *BEST.get_or_init(|| unsafe { Fns::for_isa(Isa::best()) })
    }

    /// Copies `src` into `dst` (the same length): the bytes before `dst`'s first line boundary
    /// and after its last whole step plainly, the rest streamed.
    pub(crate) fn copy(self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len(), "copy: {} bytes into {}", src.len(), dst.len());
        let Some(stream) = self.stream else {
            dst.copy_from_slice(src);
            return;
        };
        let (head, body) = split(dst.as_ptr().addr(), dst.len());
        let (dst_head, rest) = dst.split_at_mut(head);
        let (dst_body, dst_tail) = rest.split_at_mut(body);
        let (src_head, rest) = src.split_at(head);
        let (src_body, src_tail) = rest.split_at(body);
        dst_head.copy_from_slice(src_head);
        if body > 0 {
            // SAFETY: `self` was built for an ISA this host has (`for_isa`'s contract);
            // `dst_body` starts on a line boundary (`head` bytes in) and both ranges hold `body`
            // bytes, a multiple of STEP; a `&mut` and a `&` cannot overlap.
            unsafe { stream(dst_body.as_mut_ptr(), src_body.as_ptr(), body) };
        }
        dst_tail.copy_from_slice(src_tail);
    }
}

/// `(head, body)` of a copy of `len` bytes to address `addr`: the bytes before the first line
/// boundary (all of them if it lies past the end), then the whole steps from there. Address
/// arithmetic, not `align_offset`, whose result the streaming stores' alignment must not rest on.
pub(crate) fn split(addr: usize, len: usize) -> (usize, usize) {
    let head = (addr.wrapping_neg() % LINE).min(len);
    (head, (len - head) / STEP * STEP)
}

/// Copies `src` into `dst` (the same length) with streaming stores where the best ISA this host
/// has them: the bytes of `dst.copy_from_slice(src)`, without reading `dst`'s lines into the
/// caches first or leaving the bytes there. For large copies whose destination is read later,
/// or by another core.
///
/// # Panics
/// If the lengths differ.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    Fns::best().copy(dst, src);
}

#[cfg(test)]
mod tests;
