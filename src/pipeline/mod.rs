//! The pipeline around the model: which cores and NUMA node serve which stage (I/O threads that
//! own the rings, the compute pool, the scheduler walking the layers), and pinning threads there.
#![forbid(unsafe_code)]

pub mod placement;

pub use placement::{Placement, PlacementError, PlacementRequest};
