#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::print_stderr)]

mod checkpoint_tests;
mod cli_tests;
mod common;
mod config_tests;
mod oracle_tests;
mod streaming_tests;
mod tokenizer_tests;
