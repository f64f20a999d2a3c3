//! The alignment of the pack's units: what every device a streamed run reads from needs.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::UNIT_ALIGN_MIN;
use crate::storage::io::dio_alignment;

/// Unit alignment for a pack in `out_dir` of a checkpoint whose shards are `shards`: the
/// strictest direct-I/O alignment (memory and offset) of the pack's device and the shards'
/// devices, at least 4096. A streamed run refuses a pack aligned to less than what the devices
/// it reads from need (they are checked together), so the pack takes the shards' into account.
pub fn unit_alignment(out_dir: &Path, shards: &[PathBuf]) -> u64 {
    let probe = out_dir.join(".k3ring-align-probe");
    let pack_device = File::create(&probe).map(|f| u64::from(dio_alignment(&f, &probe).strictest())).unwrap_or(0);
    let _ = std::fs::remove_file(&probe);
    let shard_devices =
        shards.iter().filter_map(|p| File::open(p).ok().map(|f| u64::from(dio_alignment(&f, p).strictest())));
    shard_devices.fold(pack_device, u64::max).max(UNIT_ALIGN_MIN)
}

/// Why a pack whose units are aligned to `packed` must be packed again for devices that need
/// `needed`; `None` when its alignment serves them.
pub fn misaligned(packed: u64, needed: u64) -> Option<String> {
    (!packed.is_multiple_of(needed))
        .then(|| format!("its units are aligned to {packed} bytes but the device needs {needed}"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn a_pack_aligned_below_what_the_device_needs_is_packed_again() {
        assert_eq!(misaligned(4096, 4096), None);
        assert_eq!(misaligned(8192, 4096), None);
        let why = misaligned(4096, 8192).unwrap();
        assert_eq!(why, "its units are aligned to 4096 bytes but the device needs 8192");
    }

    #[test]
    fn the_alignment_is_at_least_4096_and_a_power_of_two() {
        let tmp = tempfile::tempdir().unwrap();
        let shard = tmp.path().join("s");
        std::fs::write(&shard, b"x").unwrap();
        let a = unit_alignment(tmp.path(), &[shard]);
        assert!(a >= UNIT_ALIGN_MIN && a.is_power_of_two(), "{a}");
        assert!(!tmp.path().join(".k3ring-align-probe").exists());
    }
}
