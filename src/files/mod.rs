//! The one rule for every file a flag names (docs/FAULTS.md "Files"): how outputs are written
//! ([`output`]) and how inputs are opened and bounded ([`input`]).
//!
//! A leaf beside `exit`: it depends on nothing else in the crate, so the engine (state files),
//! storage (model files, packs) and the CLI (reports, traces, histories) share it.

pub mod input;
pub mod output;

pub use input::{InputError, LineRead};
pub use output::{Output, OutputError, OutputWriter};

/// What a file that is not a regular one is, in words for an error message.
pub fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "a regular file"
    }
}
