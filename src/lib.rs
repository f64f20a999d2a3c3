//! k3ring: runs the Kimi K3 mixture-of-experts model on CPUs with far less RAM than the model,
//! by streaming its weights from NVMe.
//!
//! Dependencies point one way: `cli -> engine -> pipeline -> {model, storage} -> kernels`;
//! `config` and `checkpoint` depend only on `exit` (the exit codes and the `Classify` trait every
//! error type implements) and `files` (how every file is opened, bounded and written), and so
//! does `interrupt` (the Ctrl-C flag); `exit`, `rng` and `memory` (what the process may still
//! allocate) depend on nothing.

pub mod chat;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod engine;
pub mod error;
pub mod exit;
pub mod files;
pub mod interrupt;
pub mod memory;
pub mod model;
pub mod pipeline;
pub mod rng;
pub mod serve;
pub mod storage;
pub mod synth;
pub mod tokenizer;
pub mod trace;
