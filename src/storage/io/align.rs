//! The direct-I/O alignment of a file, asked of the kernel, never assumed (house rule 14).
//!
//! Order: `statx(STATX_DIOALIGN)` (Linux 6.1+, on filesystems that fill it in), then the block
//! device's `queue/logical_block_size` in sysfs (the partition's parent when the partition has
//! no `queue/`), then [`DIO_ALIGN_DEFAULT`]. Runs once per file at startup; allocates only paths.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::error::IoError;

/// The alignment used when neither statx nor sysfs answers: the page size, which every block
/// device's logical block size divides.
pub const DIO_ALIGN_DEFAULT: u32 = 4096;

/// Smallest logical block size a Linux block device can have.
pub const DIO_ALIGN_MIN: u32 = 512;

// `statx` writes up to 256 bytes; libc's struct must be exactly the kernel's `struct statx`.
const _: () = assert!(std::mem::size_of::<libc::statx>() == 256);

/// Where a [`DioAlign`] came from, for the plan printout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AlignSource {
    /// `statx(STATX_DIOALIGN)` on the open file.
    Statx,
    /// The named sysfs `logical_block_size` file.
    Sysfs(PathBuf),
    /// Neither answered; [`DIO_ALIGN_DEFAULT`].
    Default,
}

/// Direct-I/O alignment: `dst` addresses must be multiples of `mem_align`; file offsets and
/// lengths multiples of `offset_align`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DioAlign {
    /// Alignment of the memory address of a read.
    pub mem_align: u32,
    /// Alignment of a read's file offset and length.
    pub offset_align: u32,
    /// Which source answered.
    pub source: AlignSource,
}

impl DioAlign {
    /// The stricter of the two alignments: what a chunk boundary inside one read must respect,
    /// since it moves both the file offset and the memory address.
    pub fn strictest(&self) -> u32 {
        self.mem_align.max(self.offset_align)
    }

    /// Combines two files' alignments: the stricter of each; the source of the stricter offset.
    pub fn max(self, other: DioAlign) -> DioAlign {
        let source = if other.offset_align > self.offset_align { other.source } else { self.source };
        DioAlign {
            mem_align: self.mem_align.max(other.mem_align),
            offset_align: self.offset_align.max(other.offset_align),
            source,
        }
    }
}

/// The direct-I/O alignment of `file` (opened from `path`, which is used for logging only).
pub fn dio_alignment(file: &File, path: &Path) -> DioAlign {
    if let Some((mem_align, offset_align)) = statx_dio_align(file) {
        tracing::debug!(path = %path.display(), mem_align, offset_align, "DIO alignment from statx");
        return DioAlign { mem_align, offset_align, source: AlignSource::Statx };
    }
    let sysfs = file.metadata().ok().and_then(|meta| {
        let dev = meta.dev();
        sysfs_logical_block_size(Path::new("/sys"), libc::major(dev), libc::minor(dev))
    });
    if let Some((size, source_path)) = sysfs {
        tracing::debug!(path = %path.display(), size, sysfs = %source_path.display(), "DIO alignment from sysfs");
        return DioAlign { mem_align: size, offset_align: size, source: AlignSource::Sysfs(source_path) };
    }
    tracing::debug!(path = %path.display(), "DIO alignment unknown; assuming {DIO_ALIGN_DEFAULT}");
    DioAlign { mem_align: DIO_ALIGN_DEFAULT, offset_align: DIO_ALIGN_DEFAULT, source: AlignSource::Default }
}

/// Opens every file read-only with `O_DIRECT | O_CLOEXEC` and returns them with the strictest
/// alignment over all of them, raised to at least `align_min` (0 for none; tests use 4096 to run
/// with a stricter alignment than the device's).
pub fn open_direct(paths: &[PathBuf], align_min: u32) -> Result<(Vec<File>, DioAlign), IoError> {
    assert!(align_min == 0 || align_min.is_power_of_two(), "align_min {align_min} is not a power of two");
    let mut files = Vec::with_capacity(paths.len());
    let mut strictest: Option<DioAlign> = None;
    for path in paths {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| IoError::Open { path: path.clone(), source })?;
        let this = dio_alignment(&file, path);
        let this = DioAlign {
            mem_align: this.mem_align.max(align_min),
            offset_align: this.offset_align.max(align_min),
            source: this.source,
        };
        strictest = Some(match strictest {
            None => this,
            Some(so_far) => so_far.max(this),
        });
        files.push(file);
    }
    let fallback = align_min.max(DIO_ALIGN_DEFAULT);
    let align =
        strictest.unwrap_or(DioAlign { mem_align: fallback, offset_align: fallback, source: AlignSource::Default });
    assert!(align.offset_align.is_power_of_two());
    assert!(align.mem_align.is_power_of_two());
    Ok((files, align))
}

/// `(mem_align, offset_align)` from `statx`, or None when the kernel or filesystem does not
/// report them (mask bit clear, or zero: the file does not support direct I/O).
fn statx_dio_align(file: &File) -> Option<(u32, u32)> {
    // SAFETY: `libc::statx` is a plain C struct of integers, for which all-zero bytes are a
    // valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the fd is open for the duration of the call (borrowed from `file`); the path is a
    // NUL-terminated empty string, valid with AT_EMPTY_PATH; `stx` is a live, writable struct of
    // the size the kernel writes (asserted above).
    let rc =
        unsafe { libc::statx(file.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    let (mem, offset) = (stx.stx_dio_mem_align, stx.stx_dio_offset_align);
    if offset < DIO_ALIGN_MIN || !offset.is_power_of_two() || mem == 0 || !mem.is_power_of_two() {
        return None;
    }
    Some((mem, offset))
}

/// The logical block size of block device `major:minor` under sysfs root `sys_root`, and the
/// file it was read from. A partition has no `queue/`, so its parent device's is used.
pub fn sysfs_logical_block_size(sys_root: &Path, major: u32, minor: u32) -> Option<(u32, PathBuf)> {
    let dev_dir = sys_root.join("dev/block").join(format!("{major}:{minor}"));
    let candidates = [dev_dir.join("queue/logical_block_size"), dev_dir.join("../queue/logical_block_size")];
    for candidate in candidates {
        let Ok(text) = std::fs::read_to_string(&candidate) else { continue };
        let Ok(size) = text.trim().parse::<u32>() else { continue };
        if size >= DIO_ALIGN_MIN && size.is_power_of_two() {
            return Some((size, candidate));
        }
    }
    None
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    #[test]
    fn tmp_files_report_a_power_of_two_at_least_512() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let path = dir.path().join("a.bin");
        std::fs::write(&path, vec![7u8; 8192]).unwrap();
        let file = File::open(&path).unwrap();
        let align = dio_alignment(&file, &path);
        assert!(align.offset_align >= DIO_ALIGN_MIN, "{align:?}");
        assert!(align.offset_align.is_power_of_two(), "{align:?}");
        assert!(align.mem_align.is_power_of_two(), "{align:?}");
    }

    #[test]
    fn odirect_read_with_the_reported_alignment_works() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let path = dir.path().join("b.bin");
        let data: Vec<u8> = (0..65536u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::File::create(&path).unwrap().write_all(&data).unwrap();
        let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path).unwrap();
        let align = dio_alignment(&file, &path);
        let unit = align.strictest() as usize;
        let mut backing = vec![0u8; unit * 4];
        let start = backing.as_ptr().align_offset(unit);
        let window = &mut backing[start..start + unit * 2];
        let n = file.read_at(window, unit as u64).unwrap();
        assert_eq!(n, unit * 2);
        assert_eq!(window, &data[unit..unit * 3]);
    }

    #[test]
    fn sysfs_fallback_uses_the_partition_parent() {
        let root = tempfile::tempdir().unwrap();
        let disk = root.path().join("devices/nvme0n1");
        std::fs::create_dir_all(disk.join("queue")).unwrap();
        std::fs::create_dir_all(disk.join("nvme0n1p1")).unwrap();
        std::fs::write(disk.join("queue/logical_block_size"), "4096\n").unwrap();
        std::fs::create_dir_all(root.path().join("dev/block")).unwrap();
        std::os::unix::fs::symlink(disk.join("nvme0n1p1"), root.path().join("dev/block/259:1")).unwrap();
        std::os::unix::fs::symlink(&disk, root.path().join("dev/block/259:0")).unwrap();
        let (size, from) = sysfs_logical_block_size(root.path(), 259, 1).unwrap();
        assert_eq!(size, 4096);
        assert!(from.ends_with("259:1/../queue/logical_block_size"), "{}", from.display());
        let (size, from) = sysfs_logical_block_size(root.path(), 259, 0).unwrap();
        assert_eq!(size, 4096);
        assert!(from.ends_with("259:0/queue/logical_block_size"), "{}", from.display());
        assert_eq!(sysfs_logical_block_size(root.path(), 8, 0), None);
    }

    #[test]
    fn max_keeps_the_stricter_alignment() {
        let a = DioAlign { mem_align: 512, offset_align: 512, source: AlignSource::Statx };
        let b = DioAlign { mem_align: 4, offset_align: 4096, source: AlignSource::Default };
        let m = a.max(b);
        assert_eq!((m.mem_align, m.offset_align, m.source), (512, 4096, AlignSource::Default));
    }
}
