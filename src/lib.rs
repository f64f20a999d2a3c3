//! k3ring: runs the Kimi K3 mixture-of-experts model on CPUs with far less RAM than the model,
//! by streaming its weights from NVMe.
//!
//! Dependencies point one way: `cli -> engine -> pipeline -> {model, storage} -> kernels`;
//! `config` and `checkpoint` depend only on `exit` (the exit codes and the `Classify` trait every
//! error type implements); `exit` and `rng` depend on nothing.

pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod engine;
pub mod error;
pub mod exit;
pub mod model;
pub mod pipeline;
pub mod rng;
pub mod storage;
pub mod synth;
pub mod tokenizer;
pub mod trace;
