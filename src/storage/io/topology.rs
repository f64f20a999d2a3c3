//! NUMA nodes, their CPUs and memory, read from sysfs once at startup.
//!
//! Source: `<root>/devices/system/node/node<N>/{cpulist,meminfo}`. A kernel without NUMA has no
//! `node/` directory: then there is one node 0 holding every CPU of
//! `<root>/devices/system/cpu/online`. The root is a parameter so tests run on fixture trees.
//! Placement (which cores compute, which one drives the ring, how big each node's arena is) is
//! decided elsewhere from this data (house rule 16).
//!
//! With the `hwloc` cargo feature, [`Topology::detect`] asks hwloc (through hwlocality) instead,
//! and falls back to sysfs with a warning when hwloc fails; [`Topology::from_hwloc_synthetic`]
//! builds test topologies from hwloc's synthetic descriptions. hwloc reports only the CPUs and
//! nodes this process may use (a cgroup cpuset can hide some), sysfs every online one.

use std::path::{Path, PathBuf};

use super::error::IoError;

/// Highest CPU id a cpulist may name; a bound on the parser's output, far above any real server.
pub const CPU_ID_MAX: usize = 1 << 16;

/// One NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaNode {
    /// The node id (`N` of `nodeN`).
    pub id: u32,
    /// Its online CPUs, ascending.
    pub cpus: Vec<usize>,
    /// `MemTotal` of the node's `meminfo`, when readable.
    pub mem_bytes: Option<u64>,
}

/// The machine's NUMA nodes, ascending by id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub nodes: Vec<NumaNode>,
}

impl Topology {
    /// Reads the running machine's topology: from hwloc with the `hwloc` feature (sysfs when
    /// hwloc fails), otherwise from `/sys`.
    pub fn detect() -> Result<Topology, IoError> {
        #[cfg(feature = "hwloc")]
        match hwlocality::Topology::new() {
            Ok(topo) => match Topology::from_hwloc(&topo) {
                Ok(ours) => return Ok(ours),
                Err(e) => tracing::warn!("hwloc topology unusable, reading /sys instead: {e}"),
            },
            Err(e) => tracing::warn!("hwloc topology detection failed, reading /sys instead: {e}"),
        }
        Topology::from_sysfs(Path::new("/sys"))
    }

    /// Reads the topology from a sysfs tree rooted at `root` (the directory holding `devices/`).
    pub fn from_sysfs(root: &Path) -> Result<Topology, IoError> {
        let node_dir = root.join("devices/system/node");
        let mut ids = node_ids(&node_dir)?;
        if ids.is_empty() {
            let path = root.join("devices/system/cpu/online");
            let cpus = parse_cpulist(&read(&path)?, &path)?;
            return Ok(Topology { nodes: vec![NumaNode { id: 0, cpus, mem_bytes: None }] });
        }
        ids.sort_unstable();
        let mut nodes = Vec::with_capacity(ids.len());
        for id in ids {
            let dir = node_dir.join(format!("node{id}"));
            let path = dir.join("cpulist");
            let cpus = parse_cpulist(&read(&path)?, &path)?;
            let mem_bytes = std::fs::read_to_string(dir.join("meminfo")).ok().and_then(|text| mem_total(&text));
            nodes.push(NumaNode { id, cpus, mem_bytes });
        }
        Ok(Topology { nodes })
    }

    /// Every CPU of every node, ascending.
    pub fn cpus(&self) -> Vec<usize> {
        let mut all: Vec<usize> = self.nodes.iter().flat_map(|n| n.cpus.iter().copied()).collect();
        all.sort_unstable();
        all
    }

    /// The node holding `cpu`.
    pub fn node_of_cpu(&self, cpu: usize) -> Option<u32> {
        self.nodes.iter().find(|n| n.cpus.binary_search(&cpu).is_ok()).map(|n| n.id)
    }
}

#[cfg(feature = "hwloc")]
impl Topology {
    /// Builds the topology from an hwloc one: each NUMA node's OS index, the OS indices of its
    /// CPUs (PUs), and its local memory when hwloc knows it. Nodes without CPUs (CXL or HBM
    /// memory) are kept with an empty CPU list, as sysfs shows them.
    pub fn from_hwloc(topo: &hwlocality::Topology) -> Result<Topology, IoError> {
        use hwlocality::object::{attributes::ObjectAttributes, types::ObjectType};
        let mut nodes = Vec::new();
        for obj in topo.objects_with_type(ObjectType::NUMANode) {
            let Some(id) = obj.os_index().and_then(|i| u32::try_from(i).ok()) else {
                return Err(hwloc_error(format!("NUMA node #{} has no usable OS index", obj.logical_index())));
            };
            let Some(cpuset) = obj.cpuset() else {
                return Err(hwloc_error(format!("NUMA node {id} has no cpuset")));
            };
            let Some(cpu_count) = cpuset.weight() else {
                return Err(hwloc_error(format!("NUMA node {id} has an infinite cpuset")));
            };
            let mut cpus = Vec::with_capacity(cpu_count);
            for cpu in cpuset.iter_set().map(usize::from) {
                if cpu > CPU_ID_MAX {
                    return Err(hwloc_error(format!("NUMA node {id} holds CPU {cpu}, above the limit {CPU_ID_MAX}")));
                }
                cpus.push(cpu);
            }
            assert_eq!(cpus.len(), cpu_count);
            assert!(cpus.windows(2).all(|w| w[0] < w[1]), "hwloc bitmaps iterate ascending");
            let mem_bytes = match obj.attributes() {
                Some(ObjectAttributes::NUMANode(attr)) => attr.local_memory().map(|m| m.get()),
                _ => None,
            };
            nodes.push(NumaNode { id, cpus, mem_bytes });
        }
        if nodes.is_empty() {
            return Err(hwloc_error("no NUMA node".to_string()));
        }
        nodes.sort_unstable_by_key(|n| n.id);
        if nodes.windows(2).any(|w| w[0].id == w[1].id) {
            return Err(hwloc_error("two NUMA nodes share an OS index".to_string()));
        }
        Ok(Topology { nodes })
    }

    /// Builds the topology of an hwloc synthetic description, e.g. `"pack:2 numa:1 core:64
    /// pu:1"` for two packages of 64 cores with one NUMA node each (hwloc numbers the nodes and
    /// PUs of a synthetic topology in order: nodes 0-1, CPUs 0-63 and 64-127). For tests and
    /// for planning a placement for another machine.
    pub fn from_hwloc_synthetic(description: &str) -> Result<Topology, IoError> {
        let setup = |e: &dyn std::fmt::Display| IoError::Setup {
            what: format!("the hwloc synthetic topology {description:?}"),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()),
        };
        let builder = hwlocality::Topology::builder().from_synthetic(description).map_err(|e| setup(&e))?;
        let topo = builder.build().map_err(|e| setup(&e))?;
        Topology::from_hwloc(&topo)
    }
}

/// An hwloc topology that cannot be turned into ours.
#[cfg(feature = "hwloc")]
fn hwloc_error(why: String) -> IoError {
    IoError::Setup {
        what: "the topology from hwloc".to_string(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, why),
    }
}

fn read(path: &Path) -> Result<String, IoError> {
    std::fs::read_to_string(path).map_err(|source| IoError::Sysfs { path: path.to_path_buf(), source })
}

/// Ids of the `nodeN` entries of `dir`; empty when `dir` does not exist.
fn node_ids(dir: &Path) -> Result<Vec<u32>, IoError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(IoError::Sysfs { path: dir.to_path_buf(), source }),
    };
    let mut ids = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| IoError::Sysfs { path: dir.to_path_buf(), source })?;
        let name = entry.file_name();
        let id = name.to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse::<u32>().ok());
        if let Some(id) = id {
            ids.push(id);
        }
    }
    Ok(ids)
}

/// `MemTotal` in bytes from a node meminfo ("Node 0 MemTotal:       24576000 kB").
fn mem_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.contains("MemTotal:"))?;
    let (_, rest) = line.split_once("MemTotal:")?;
    let kib = rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    kib.checked_mul(1024)
}

/// Parses the kernel's cpulist syntax ("0-3,8-11", "5", "" for none) into ascending CPU ids.
/// `path` names the file in errors.
pub fn parse_cpulist(text: &str, path: &Path) -> Result<Vec<usize>, IoError> {
    let text = text.trim();
    let fail = |why: String| IoError::CpuList { path: PathBuf::from(path), text: text.to_string(), why };
    let mut cpus = Vec::new();
    if text.is_empty() {
        return Ok(cpus);
    }
    for part in text.split(',') {
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (parse_cpu(a, part).map_err(&fail)?, parse_cpu(b, part).map_err(&fail)?),
            None => {
                let cpu = parse_cpu(part, part).map_err(&fail)?;
                (cpu, cpu)
            }
        };
        if first > last {
            return Err(fail(format!("range {part:?} runs backwards")));
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    let before = cpus.len();
    cpus.dedup();
    if cpus.len() != before {
        return Err(fail("a CPU is listed twice".to_string()));
    }
    Ok(cpus)
}

fn parse_cpu(s: &str, part: &str) -> Result<usize, String> {
    let cpu = s.trim().parse::<usize>().map_err(|_| format!("{part:?} is not a CPU number or range"))?;
    if cpu > CPU_ID_MAX {
        return Err(format!("CPU {cpu} is above the limit {CPU_ID_MAX}"));
    }
    Ok(cpu)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, text: &str) {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn one_node_two_cpus() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), "devices/system/node/node0/cpulist", "0-1\n");
        write(
            root.path(),
            "devices/system/node/node0/meminfo",
            "Node 0 MemTotal:       24576000 kB\nNode 0 MemFree: 1 kB\n",
        );
        write(root.path(), "devices/system/node/online", "0\n");
        let topo = Topology::from_sysfs(root.path()).unwrap();
        assert_eq!(topo.nodes, vec![NumaNode { id: 0, cpus: vec![0, 1], mem_bytes: Some(24_576_000 * 1024) }]);
    }

    #[test]
    fn two_packages_of_64_cores() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), "devices/system/node/node1/cpulist", "64-127\n");
        write(root.path(), "devices/system/node/node0/cpulist", "0-63\n");
        write(root.path(), "devices/system/node/node0/meminfo", "Node 0 MemTotal: 1048576 kB\n");
        let topo = Topology::from_sysfs(root.path()).unwrap();
        assert_eq!(topo.nodes.len(), 2);
        assert_eq!((topo.nodes[0].id, topo.nodes[1].id), (0, 1));
        assert_eq!(topo.nodes[0].cpus, (0..64).collect::<Vec<_>>());
        assert_eq!(topo.nodes[1].cpus, (64..128).collect::<Vec<_>>());
        assert_eq!(topo.nodes[0].mem_bytes, Some(1 << 30));
        assert_eq!(topo.nodes[1].mem_bytes, None);
        assert_eq!(topo.node_of_cpu(70), Some(1));
        assert_eq!(topo.cpus().len(), 128);
    }

    #[test]
    fn no_node_directory_falls_back_to_online_cpus() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), "devices/system/cpu/online", "0-3,8-11\n");
        let topo = Topology::from_sysfs(root.path()).unwrap();
        assert_eq!(topo.nodes, vec![NumaNode { id: 0, cpus: vec![0, 1, 2, 3, 8, 9, 10, 11], mem_bytes: None }]);
    }

    #[test]
    fn malformed_cpulist_names_the_file() {
        let root = tempfile::tempdir().unwrap();
        write(root.path(), "devices/system/node/node0/cpulist", "0-3,x\n");
        let err = Topology::from_sysfs(root.path()).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("devices/system/node/node0/cpulist"), "{text}");
        assert!(text.ends_with(": malformed cpu list \"0-3,x\": \"x\" is not a CPU number or range"), "{text}");
        let err = parse_cpulist("5-2", Path::new("/sys/x")).unwrap_err();
        assert_eq!(err.to_string(), "/sys/x: malformed cpu list \"5-2\": range \"5-2\" runs backwards");
    }

    #[test]
    fn cpulist_syntax() {
        let p = Path::new("/f");
        assert_eq!(parse_cpulist("", p).unwrap(), Vec::<usize>::new());
        assert_eq!(parse_cpulist("7\n", p).unwrap(), vec![7]);
        assert_eq!(parse_cpulist("0-1,4,6-7", p).unwrap(), vec![0, 1, 4, 6, 7]);
        assert!(parse_cpulist("0-1,1", p).is_err());
        assert!(parse_cpulist("0,,1", p).is_err());
    }

    #[test]
    fn detects_this_machine() {
        let topo = Topology::detect().unwrap();
        assert!(!topo.nodes.is_empty());
        assert!(!topo.cpus().is_empty());
    }
}

#[cfg(all(test, feature = "hwloc"))]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]
mod hwloc_tests {
    use super::*;

    #[test]
    fn synthetic_two_packages_of_64_cores() {
        let topo = Topology::from_hwloc_synthetic("pack:2 numa:1 core:64 pu:1").unwrap();
        assert_eq!(topo.nodes.len(), 2);
        assert_eq!((topo.nodes[0].id, topo.nodes[1].id), (0, 1));
        assert_eq!(topo.nodes[0].cpus, (0..64).collect::<Vec<_>>());
        assert_eq!(topo.nodes[1].cpus, (64..128).collect::<Vec<_>>());
        assert_eq!(topo.node_of_cpu(70), Some(1));
        assert_eq!(topo.cpus().len(), 128);
    }

    #[test]
    fn synthetic_memory_size_is_read() {
        let topo = Topology::from_hwloc_synthetic("numa:2(memory=1GiB) pu:2").unwrap();
        assert_eq!(topo.nodes.len(), 2);
        assert!(topo.nodes.iter().all(|n| n.mem_bytes == Some(1 << 30)), "{topo:?}");
    }

    #[test]
    fn a_bad_synthetic_description_is_refused_with_its_text() {
        let err = Topology::from_hwloc_synthetic("pack:x").unwrap_err();
        assert!(err.to_string().starts_with("cannot set up the hwloc synthetic topology \"pack:x\": "), "{err}");
    }

    /// hwloc and sysfs must agree on this machine. hwloc hides CPUs a cgroup cpuset forbids;
    /// then only inclusion is checked.
    #[test]
    fn hwloc_matches_sysfs_on_this_machine() {
        let hw = hwlocality::Topology::new().unwrap();
        let ours = Topology::from_hwloc(&hw).unwrap();
        let sysfs = Topology::from_sysfs(Path::new("/sys")).unwrap();
        let ids = |t: &Topology| t.nodes.iter().map(|n| n.id).collect::<Vec<_>>();
        let restricted = hw.allowed_cpuset().weight() != hw.complete_cpuset().weight()
            || hw.allowed_nodeset().weight() != hw.complete_nodeset().weight();
        if restricted {
            eprintln!("SKIPPED: exact hwloc/sysfs match, this process is restricted to a subset of CPUs or nodes");
            assert!(ids(&ours).iter().all(|id| ids(&sysfs).contains(id)));
            assert!(ours.cpus().iter().all(|cpu| sysfs.cpus().contains(cpu)));
            return;
        }
        assert_eq!(ids(&ours), ids(&sysfs));
        for (h, s) in ours.nodes.iter().zip(&sysfs.nodes) {
            assert_eq!(h.cpus, s.cpus, "node {}", h.id);
            // hwloc subtracts reserved huge pages from MemTotal, so it may only be smaller.
            if let (Some(h_bytes), Some(s_bytes)) = (h.mem_bytes, s.mem_bytes) {
                assert!(h_bytes <= s_bytes, "node {}: hwloc {h_bytes} > sysfs {s_bytes}", h.id);
            }
        }
        assert_eq!(Topology::detect().unwrap(), ours);
    }
}
