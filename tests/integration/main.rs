#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::print_stderr)]

mod advice_tests;
mod attribution_tests;
mod batch_tests;
mod cache_sim_tests;
mod chat_tests;
mod checkpoint_tests;
mod cli_tests;
mod common;
mod config_tests;
mod draft_tests;
mod fault_tests;
mod faults_doc_tests;
mod hostile_tests;
mod integrity_tests;
mod limits_tests;
mod oracle_tests;
mod pieces_tests;
mod pipeline_tests;
mod plan_tests;
mod row_block_tests;
mod serve_tests;
mod soak_tests;
mod streaming_tests;
mod synth_tests;
mod tokenizer_tests;
mod trace_check;
