//! Where weight bytes live. Implementations of [`crate::model::weights::WeightSource`]:
//! the in-memory store over mapped shards (this module's [`mmap::MmapSource`]).
//!
//! This and `storage::io` are the only modules allowed unsafe code (mmap, io_uring buffers,
//! mlock); each unsafe block states its invariant.

pub mod io;
pub mod mmap;
pub mod pack;
pub mod plan;
pub mod stream;
