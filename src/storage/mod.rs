//! Where weight bytes live: the in-memory store over mapped shards ([`mmap::MmapSource`], a
//! [`crate::model::weights::WeightSource`] itself), the read layer ([`io`]), the trunk pack
//! ([`pack`]), the memory plan ([`plan`]) and the streaming store ([`stream`]), which the
//! pipeline (`crate::pipeline`) drives.
//!
//! This and `storage::io` are the only modules allowed unsafe code (mmap, io_uring buffers,
//! mlock, the SIGBUS handler of [`sigbus`]); each unsafe block states its invariant.

pub mod expert_files;
pub mod io;
pub mod mmap;
pub mod pack;
pub mod plan;
pub mod sigbus;
pub mod stream;
