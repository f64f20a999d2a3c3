#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::print_stderr)]

mod cache_sim_tests;
mod checkpoint_tests;
mod cli_tests;
mod common;
mod config_tests;
mod oracle_tests;
mod pipeline_tests;
mod streaming_tests;
mod synth_tests;
mod tokenizer_tests;
