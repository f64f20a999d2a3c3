//! The memory cgroups of this process and their headroom (limit minus usage).
//!
//! Which cgroups: `/proc/self/cgroup` names the process's cgroup in each hierarchy (`0::/path`
//! for v2, `N:memory:/path` for the v1 memory controller); `/proc/self/mountinfo` says where each
//! hierarchy is mounted and which part of it (its root). The directory is the mount point plus
//! the path below that root. A limit set on an ancestor binds too (a container's limit often sits
//! one level up), so every directory from the process's own up to the mount point is read and
//! each one with a limit counts.
//!
//! Usage is the working set as the kubelet computes it: `memory.current` (v2) or
//! `memory.usage_in_bytes` (v1) minus the inactive file cache of `memory.stat`, which the kernel
//! reclaims before it kills anything.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// v1 reports "no limit" as `PAGE_COUNTER_MAX` pages (9223372036854771712 bytes with 4 KiB
/// pages); anything at or above this is no limit.
const V1_UNLIMITED: u64 = 1 << 62;

/// One cgroup's memory limit and working set, in bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CgroupLimit {
    /// 1 or 2.
    pub version: u8,
    /// `memory.max` or `memory.limit_in_bytes`, for messages.
    pub limit_file: PathBuf,
    pub limit: u64,
    /// Usage less inactive file cache.
    pub usage: u64,
}

impl CgroupLimit {
    /// Bytes left before the limit (0 when usage already exceeds it).
    pub fn headroom(&self) -> u64 {
        self.limit.saturating_sub(self.usage)
    }
}

/// A line of `/proc/self/cgroup`: `hierarchy-id:controller,list:/path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcCgroup {
    pub hierarchy: u32,
    /// Empty for the v2 unified hierarchy.
    pub controllers: Vec<String>,
    pub path: String,
}

/// The cgroup parts of a `/proc/self/mountinfo` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    /// The path inside the filesystem that is mounted (field 4).
    pub root: String,
    pub mount_point: PathBuf,
    pub fstype: String,
    pub super_options: Vec<String>,
}

/// A memory cgroup of this process: its directory and the mount point above which nothing is
/// visible.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryCgroup {
    pub version: u8,
    pub dir: PathBuf,
    pub mount_point: PathBuf,
}

/// Parses `/proc/self/cgroup`; malformed lines are skipped.
pub fn parse_proc_cgroup(text: &str) -> Vec<ProcCgroup> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let hierarchy = parts.next()?.parse().ok()?;
            let controllers = parts.next()?.split(',').filter(|c| !c.is_empty()).map(str::to_owned).collect();
            let path = parts.next()?.to_owned();
            Some(ProcCgroup { hierarchy, controllers, path })
        })
        .collect()
}

/// Parses the cgroup and cgroup2 mounts of `/proc/self/mountinfo`; other lines are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let dash = fields.iter().position(|f| *f == "-")?;
            let (root, mount_point) = (fields.get(3)?, fields.get(4)?);
            let fstype = *fields.get(dash + 1)?;
            if fstype != "cgroup" && fstype != "cgroup2" {
                return None;
            }
            let super_options = fields.get(dash + 3).map_or(Vec::new(), |o| o.split(',').map(str::to_owned).collect());
            Some(Mount {
                root: unescape(root),
                mount_point: PathBuf::from(unescape(mount_point)),
                fstype: fstype.to_owned(),
                super_options,
            })
        })
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\134` for a backslash, ...).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                let v = d.iter().fold(0u32, |v, b| v * 8 + u32::from(b - b'0'));
                out.push(v as u8);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The memory cgroups of a process given its `/proc/self/cgroup` lines and the cgroup mounts:
/// the v1 memory hierarchy and the v2 unified one, each where mounted.
pub fn memory_cgroups(cgroups: &[ProcCgroup], mounts: &[Mount]) -> Vec<MemoryCgroup> {
    let mut out = Vec::new();
    for cg in cgroups {
        let v1 = cg.controllers.iter().any(|c| c == "memory");
        let v2 = cg.hierarchy == 0 && cg.controllers.is_empty();
        let mount = mounts.iter().find(|m| {
            (v1 && m.fstype == "cgroup" && m.super_options.iter().any(|o| o == "memory"))
                || (v2 && m.fstype == "cgroup2")
        });
        let Some(mount) = mount else { continue };
        // The process's path as seen from the mount's root; a path outside it (a cgroup
        // namespace boundary) can only be read at the mount point.
        let below = Path::new(&cg.path).strip_prefix(&mount.root).unwrap_or(Path::new(""));
        let below = below.strip_prefix("/").unwrap_or(below);
        out.push(MemoryCgroup {
            version: if v1 { 1 } else { 2 },
            dir: mount.mount_point.join(below),
            mount_point: mount.mount_point.clone(),
        });
    }
    out
}

/// The limits of `cg` and of its visible ancestors, each with its working set; directories
/// without a limit (or without the files) are skipped.
pub fn limits_of(cg: &MemoryCgroup) -> Vec<CgroupLimit> {
    let (limit_name, usage_name, inactive_key) = match cg.version {
        1 => ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
        _ => ("memory.max", "memory.current", "inactive_file"),
    };
    let mut out = Vec::new();
    let mut dir = Some(cg.dir.as_path());
    while let Some(d) = dir {
        let limit_file = d.join(limit_name);
        let limit = std::fs::read_to_string(&limit_file).ok().and_then(|t| parse_limit(&t));
        if let Some(limit) = limit {
            let usage = std::fs::read_to_string(d.join(usage_name)).ok().and_then(|t| t.trim().parse::<u64>().ok());
            let inactive = std::fs::read_to_string(d.join("memory.stat"))
                .ok()
                .and_then(|t| stat_field(&t, inactive_key))
                .unwrap_or(0);
            // A limit whose usage cannot be read still bounds the process: count it as unused.
            let usage = usage.unwrap_or(0).saturating_sub(inactive);
            out.push(CgroupLimit { version: cg.version, limit_file, limit, usage });
        }
        if d == cg.mount_point {
            break;
        }
        dir = d.parent().filter(|p| p.starts_with(&cg.mount_point));
    }
    out
}

/// A limit file's value: `None` for v2's `max` or v1's "unlimited" page-counter maximum.
pub fn parse_limit(text: &str) -> Option<u64> {
    let text = text.trim();
    if text == "max" {
        return None;
    }
    text.parse::<u64>().ok().filter(|&v| v < V1_UNLIMITED)
}

/// A `key value` line of `memory.stat`.
pub fn stat_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// The memory cgroups of this process (none when /proc cannot be read).
pub fn own_memory_cgroups() -> Vec<MemoryCgroup> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    memory_cgroups(&parse_proc_cgroup(&cgroups), &parse_mountinfo(&mounts))
}

/// Every memory limit that binds this process.
pub fn own_limits() -> Vec<CgroupLimit> {
    own_memory_cgroups().iter().flat_map(limits_of).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const V1_CGROUP: &str = "9:name=systemd:/\n4:memory:/process_api/abc\n3:cpuset:/\n0::/\n";
    const V1_MOUNTS: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn proc_cgroup_lines_give_hierarchy_controllers_and_path() {
        let lines = parse_proc_cgroup(V1_CGROUP);
        assert_eq!(lines.len(), 4);
        assert_eq!(
            lines[1],
            ProcCgroup { hierarchy: 4, controllers: vec!["memory".into()], path: "/process_api/abc".into() }
        );
        assert_eq!(lines[3], ProcCgroup { hierarchy: 0, controllers: vec![], path: "/".into() });
        assert!(parse_proc_cgroup("garbage\n\n").is_empty());
    }

    #[test]
    fn mountinfo_keeps_cgroup_mounts_with_escapes_undone() {
        let text =
            format!("{V1_MOUNTS}50 31 0:40 /docker/x /sys/fs/my\\040cg rw master:3 - cgroup2 cgroup2 rw,nsdelegate\n");
        let mounts = parse_mountinfo(&text);
        assert_eq!(mounts.len(), 4, "tmpfs is not a cgroup mount: {mounts:?}");
        assert_eq!(mounts[1].super_options, ["rw", "memory"]);
        assert_eq!(mounts[3].mount_point, PathBuf::from("/sys/fs/my cg"));
        assert_eq!(mounts[3].root, "/docker/x");
    }

    #[test]
    fn v1_and_v2_directories_are_found_below_the_mount_root() {
        let found = memory_cgroups(&parse_proc_cgroup(V1_CGROUP), &parse_mountinfo(V1_MOUNTS));
        assert_eq!(
            found,
            [
                MemoryCgroup {
                    version: 1,
                    dir: "/sys/fs/cgroup/memory/process_api/abc".into(),
                    mount_point: "/sys/fs/cgroup/memory".into()
                },
                MemoryCgroup {
                    version: 2,
                    dir: "/sys/fs/cgroup/unified".into(),
                    mount_point: "/sys/fs/cgroup/unified".into()
                },
            ]
        );
        // A container without a cgroup namespace: the mount's root is the container's cgroup.
        let mounts = parse_mountinfo("1 0 0:1 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
        let found = memory_cgroups(&parse_proc_cgroup("0::/docker/abc/inner\n"), &mounts);
        assert_eq!(found[0].dir, PathBuf::from("/sys/fs/cgroup/inner"));
    }

    #[test]
    fn limit_files_read_max_and_v1_unlimited_as_none() {
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(parse_limit("734003200\n"), Some(734_003_200));
        assert_eq!(parse_limit("junk"), None);
        assert_eq!(stat_field("cache 5\ninactive_file 4096\nactive_file 1\n", "inactive_file"), Some(4096));
        assert_eq!(stat_field("total_inactive_file 7\n", "inactive_file"), None);
    }

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn fake_v2_tree_limits_of_self_and_ancestors_count() {
        let tmp = tempfile::tempdir().unwrap();
        let mount = tmp.path().join("cgroup");
        let parent = mount.join("container");
        let own = parent.join("app");
        write(&mount, "memory.stat", "inactive_file 0\n"); // the root has no memory.max
        write(&parent, "memory.max", "734003200\n");
        write(&parent, "memory.current", "104857600\n");
        write(&parent, "memory.stat", "anon 1\ninactive_file 4194304\n");
        write(&own, "memory.max", "max\n");
        write(&own, "memory.current", "1000\n");
        let mountinfo = format!("30 1 0:26 / {} rw - cgroup2 cgroup2 rw\n", mount.display());
        let cgs = memory_cgroups(&parse_proc_cgroup("0::/container/app\n"), &parse_mountinfo(&mountinfo));
        assert_eq!(cgs.len(), 1);
        let limits = limits_of(&cgs[0]);
        assert_eq!(limits.len(), 1, "{limits:?}");
        assert_eq!(limits[0].limit, 734_003_200);
        assert_eq!(limits[0].usage, 104_857_600 - 4_194_304, "inactive file cache is not in the working set");
        assert_eq!(limits[0].limit_file, parent.join("memory.max"));
        let a = crate::memory::combine(Some(16 << 30), &limits).unwrap();
        assert_eq!(a.bytes, 734_003_200 - 100_663_296);
        assert!(a.to_string().contains("cgroup v2 limit"), "{a}");
    }

    #[test]
    fn fake_v1_tree_the_tightest_level_wins() {
        let tmp = tempfile::tempdir().unwrap();
        let mount = tmp.path().join("memory");
        let own = mount.join("outer/inner");
        write(&mount, "memory.limit_in_bytes", "9223372036854771712\n");
        write(&mount.join("outer"), "memory.limit_in_bytes", "2147483648\n");
        write(&mount.join("outer"), "memory.usage_in_bytes", "1073741824\n");
        write(&own, "memory.limit_in_bytes", "1610612736\n");
        write(&own, "memory.usage_in_bytes", "104857600\n");
        write(&own, "memory.stat", "cache 0\ntotal_inactive_file 0\n");
        let mountinfo = format!("35 31 0:32 / {} rw,relatime - cgroup cgroup rw,memory\n", mount.display());
        let cgs = memory_cgroups(&parse_proc_cgroup("4:memory:/outer/inner\n0::/\n"), &parse_mountinfo(&mountinfo));
        assert_eq!(cgs.len(), 1, "no cgroup2 mount, so only v1: {cgs:?}");
        let limits = limits_of(&cgs[0]);
        assert_eq!(limits.len(), 2, "{limits:?}");
        let a = crate::memory::combine(Some(16 << 30), &limits).unwrap();
        assert_eq!(a.bytes, 1 << 30, "outer: 2 GiB limit, 1 GiB used");
        let crate::memory::Limit::Cgroup(c) = &a.limited_by else { panic!("{a:?}") };
        assert_eq!(c.limit_file, mount.join("outer/memory.limit_in_bytes"));
    }

    #[test]
    fn missing_files_mean_no_limit() {
        let cg = MemoryCgroup { version: 2, dir: "/nonexistent/k3ring/cg".into(), mount_point: "/nonexistent".into() };
        assert!(limits_of(&cg).is_empty());
    }
}
