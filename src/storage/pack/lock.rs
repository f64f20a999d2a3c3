//! One `k3ring pack` per output directory: an exclusive `flock` on `trunk.lock`, taken without
//! waiting and held until the pack is written. The lock file is never removed (removing it would
//! let a third run lock a new file while the second still holds the old one); the kernel drops
//! the lock when the process ends, however it ends.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};

use super::PackError;

pub const LOCK_FILE: &str = "trunk.lock";

/// The held lock; dropping it releases it.
#[derive(Debug)]
pub struct PackLock {
    _file: File,
}

impl PackLock {
    /// Takes the lock of `out_dir` (which must exist), or says that another pack holds it.
    pub fn acquire(out_dir: &Path) -> Result<PackLock, PackError> {
        PackLock::acquire_named(out_dir, LOCK_FILE)
    }

    /// [`PackLock::acquire`] on the lock file `name` of `dir` (an expert directory's own).
    pub fn acquire_named(out_dir: &Path, name: &str) -> Result<PackLock, PackError> {
        let path: PathBuf = out_dir.join(name);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| PackError::Io { op: "create the lock file", path: path.clone(), source })?;
        match file.try_lock() {
            Ok(()) => Ok(PackLock { _file: file }),
            Err(TryLockError::WouldBlock) => Err(PackError::Busy { dir: out_dir.to_owned(), lock: path }),
            Err(TryLockError::Error(source)) => Err(PackError::Io { op: "lock", path, source }),
        }
    }
}
