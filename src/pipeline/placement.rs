//! Placement: the cores of the compute pool, the core of the I/O thread, and the NUMA node the
//! buffers are bound to, resolved once from the topology and the flags, printed, then applied
//! when threads are spawned (threads are pinned at spawn and never re-pinned).
//!
//! Default rule: use the node with the most CPUs (the lowest id on a tie), so buffers and the
//! cores that read them share a node; give the I/O thread the node's last CPU and the compute
//! pool the rest, except on nodes of fewer than four CPUs, where the I/O thread (mostly asleep in
//! the kernel) shares the last compute core rather than idling a quarter of the machine.

use serde::Serialize;

use crate::exit::{Classify, ExitCode};
use crate::storage::io::Topology;

/// Why a placement request cannot be met (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("--numa-node {node} does not exist; nodes: {nodes:?}")]
    NoNode { node: u32, nodes: Vec<u32> },
    #[error("{flag}: CPU {cpu} is not online; online CPUs: {online}")]
    NoCpu { flag: &'static str, cpu: usize, online: String },
    #[error("{flag} is empty")]
    Empty { flag: &'static str },
}

impl Classify for PlacementError {
    fn exit_code(&self) -> ExitCode {
        match self {
            PlacementError::NoNode { .. } | PlacementError::NoCpu { .. } | PlacementError::Empty { .. } => {
                ExitCode::Usage
            }
        }
    }
}

/// What the user asked for (all optional).
#[derive(Clone, Debug, Default)]
pub struct PlacementRequest {
    pub numa_node: Option<u32>,
    pub compute_cores: Option<Vec<usize>>,
    pub io_core: Option<usize>,
    /// Compute threads; 0 = every compute core.
    pub threads: usize,
}

/// Where each stage runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// Node the buffers are bound to.
    pub numa_node: u32,
    /// One compute thread per entry, pinned to it.
    pub compute_cores: Vec<usize>,
    /// The one I/O thread, pinned to this CPU.
    pub io_core: usize,
    /// Nodes the chosen cores belong to (more than one means some reads cross nodes).
    pub nodes_used: Vec<u32>,
}

impl Placement {
    /// Resolves the request against the topology.
    pub fn resolve(topo: &Topology, req: &PlacementRequest) -> Result<Placement, PlacementError> {
        let nodes: Vec<u32> = topo.nodes.iter().map(|n| n.id).collect();
        let node = match req.numa_node {
            Some(id) => topo
                .nodes
                .iter()
                .find(|n| n.id == id)
                .ok_or(PlacementError::NoNode { node: id, nodes: nodes.clone() })?,
            None => topo
                .nodes
                .iter()
                .filter(|n| !n.cpus.is_empty())
                .max_by(|a, b| a.cpus.len().cmp(&b.cpus.len()).then(b.id.cmp(&a.id)))
                .ok_or(PlacementError::NoNode { node: 0, nodes: nodes.clone() })?,
        };
        let online = topo.cpus();
        let check = |flag: &'static str, cores: &[usize]| -> Result<(), PlacementError> {
            if cores.is_empty() {
                return Err(PlacementError::Empty { flag });
            }
            match cores.iter().find(|c| !online.contains(c)) {
                Some(&cpu) => Err(PlacementError::NoCpu { flag, cpu, online: cpulist(&online) }),
                None => Ok(()),
            }
        };
        let cpus = &node.cpus;
        let shared_io = cpus.len() < 4;
        let io_core = match req.io_core {
            Some(c) => {
                check("--io-cores", &[c])?;
                c
            }
            None => cpus.last().copied().ok_or(PlacementError::Empty { flag: "--numa-node" })?,
        };
        let mut compute_cores = match &req.compute_cores {
            Some(c) => {
                check("--compute-cores", c)?;
                c.clone()
            }
            None if shared_io || req.io_core.is_some() => {
                cpus.iter().copied().filter(|&c| shared_io || c != io_core).collect()
            }
            None => cpus[..cpus.len() - 1].to_vec(),
        };
        if req.threads > 0 && req.compute_cores.is_none() {
            compute_cores.truncate(req.threads);
        }
        let mut nodes_used: Vec<u32> =
            compute_cores.iter().chain([&io_core]).filter_map(|&c| topo.node_of_cpu(c)).collect();
        nodes_used.sort_unstable();
        nodes_used.dedup();
        Ok(Placement { numa_node: node.id, compute_cores, io_core, nodes_used })
    }

    /// One line for the console.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "placement: NUMA node {} | compute {} threads on CPUs {} | I/O on CPU {}",
            self.numa_node,
            self.compute_cores.len(),
            cpulist(&self.compute_cores),
            self.io_core
        );
        if self.nodes_used.len() > 1 {
            s.push_str(&format!(
                " | warning: cores span nodes {:?}, buffers are on node {}",
                self.nodes_used, self.numa_node
            ));
        }
        s
    }
}

/// "0-3,8,10-11".
pub fn cpulist(cpus: &[usize]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        out.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    out.join(",")
}

/// Pins the calling thread to `cpu` (best effort: a failure leaves it unpinned and says so).
pub fn pin_current(cpu: usize) -> bool {
    core_affinity::set_for_current(core_affinity::CoreId { id: cpu })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::storage::io::NumaNode;

    fn topo(nodes: &[(u32, std::ops::Range<usize>)]) -> Topology {
        Topology {
            nodes: nodes
                .iter()
                .map(|(id, r)| NumaNode { id: *id, cpus: r.clone().collect(), mem_bytes: None })
                .collect(),
        }
    }

    #[test]
    fn two_packages_of_64_cores_default_to_node_0_with_a_dedicated_io_core() {
        let t = topo(&[(0, 0..64), (1, 64..128)]);
        let p = Placement::resolve(&t, &PlacementRequest::default()).unwrap();
        assert_eq!(p.numa_node, 0);
        assert_eq!(p.compute_cores, (0..63).collect::<Vec<_>>());
        assert_eq!(p.io_core, 63);
        assert_eq!(p.nodes_used, vec![0]);
        assert_eq!(cpulist(&p.compute_cores), "0-62");
    }

    #[test]
    fn a_requested_node_keeps_every_stage_on_it() {
        let t = topo(&[(0, 0..64), (1, 64..128)]);
        let p =
            Placement::resolve(&t, &PlacementRequest { numa_node: Some(1), threads: 8, ..Default::default() }).unwrap();
        assert_eq!(p.compute_cores, (64..72).collect::<Vec<_>>());
        assert_eq!(p.io_core, 127);
        assert_eq!(p.nodes_used, vec![1]);
    }

    #[test]
    fn the_larger_node_wins_by_default() {
        let t = topo(&[(0, 0..8), (1, 8..40)]);
        assert_eq!(Placement::resolve(&t, &PlacementRequest::default()).unwrap().numa_node, 1);
    }

    #[test]
    fn small_nodes_share_the_io_core() {
        let t = topo(&[(0, 0..2)]);
        let p = Placement::resolve(&t, &PlacementRequest::default()).unwrap();
        assert_eq!(p.compute_cores, vec![0, 1]);
        assert_eq!(p.io_core, 1);
    }

    #[test]
    fn explicit_cores_are_checked_and_cross_node_use_is_reported() {
        let t = topo(&[(0, 0..4), (1, 4..8)]);
        let req = PlacementRequest { compute_cores: Some(vec![0, 1, 4]), io_core: Some(7), ..Default::default() };
        let p = Placement::resolve(&t, &req).unwrap();
        assert_eq!(p.nodes_used, vec![0, 1]);
        assert!(p.describe().contains("warning: cores span nodes [0, 1]"));
        let bad = PlacementRequest { compute_cores: Some(vec![9]), ..Default::default() };
        let e = Placement::resolve(&t, &bad).unwrap_err().to_string();
        assert_eq!(e, "--compute-cores: CPU 9 is not online; online CPUs: 0-7");
        let e = Placement::resolve(&t, &PlacementRequest { numa_node: Some(3), ..Default::default() })
            .unwrap_err()
            .to_string();
        assert_eq!(e, "--numa-node 3 does not exist; nodes: [0, 1]");
    }

    #[test]
    fn an_explicit_io_core_leaves_the_compute_pool_and_is_checked() {
        let t = topo(&[(0, 0..8)]);
        let p = Placement::resolve(&t, &PlacementRequest { io_core: Some(2), ..Default::default() }).unwrap();
        assert_eq!(p.io_core, 2);
        assert_eq!(p.compute_cores, vec![0, 1, 3, 4, 5, 6, 7]);
        assert_eq!(p.describe(), "placement: NUMA node 0 | compute 7 threads on CPUs 0-1,3-7 | I/O on CPU 2");
        let e = Placement::resolve(&t, &PlacementRequest { io_core: Some(8), ..Default::default() })
            .unwrap_err()
            .to_string();
        assert_eq!(e, "--io-cores: CPU 8 is not online; online CPUs: 0-7");
    }

    #[test]
    fn sysfs_fixture_of_two_packages() {
        let dir = tempfile::tempdir().unwrap();
        for (n, list) in [(0, "0-63"), (1, "64-127")] {
            let d = dir.path().join(format!("devices/system/node/node{n}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), format!("{list}\n")).unwrap();
        }
        let t = Topology::from_sysfs(dir.path()).unwrap();
        let p = Placement::resolve(&t, &PlacementRequest { numa_node: Some(1), ..Default::default() }).unwrap();
        assert_eq!(cpulist(&p.compute_cores), "64-126");
        assert_eq!(p.io_core, 127);
    }
}

/// The placement rules on hwloc synthetic topologies, which number nodes and PUs in order.
#[cfg(all(test, feature = "hwloc"))]
#[allow(clippy::unwrap_used)]
mod hwloc_tests {
    use super::*;

    /// Two packages of 64 cores, one NUMA node each: nodes 0 and 1, CPUs 0-63 and 64-127.
    const TWO_PACKAGES: &str = "pack:2 numa:1 core:64 pu:1";

    #[test]
    fn two_packages_of_64_cores_default_to_node_0_with_a_dedicated_io_core() {
        let t = Topology::from_hwloc_synthetic(TWO_PACKAGES).unwrap();
        let p = Placement::resolve(&t, &PlacementRequest::default()).unwrap();
        assert_eq!(p.numa_node, 0);
        assert_eq!(cpulist(&p.compute_cores), "0-62");
        assert_eq!(p.io_core, 63);
        assert_eq!(p.nodes_used, vec![0]);
    }

    #[test]
    fn numa_node_1_of_two_packages_keeps_every_stage_on_it() {
        let t = Topology::from_hwloc_synthetic(TWO_PACKAGES).unwrap();
        let p = Placement::resolve(&t, &PlacementRequest { numa_node: Some(1), ..Default::default() }).unwrap();
        assert_eq!(p.numa_node, 1);
        assert_eq!(cpulist(&p.compute_cores), "64-126");
        assert_eq!(p.io_core, 127);
        assert_eq!(p.nodes_used, vec![1]);
    }

    #[test]
    fn a_single_node_of_2_pus_shares_the_io_core() {
        let t = Topology::from_hwloc_synthetic("numa:1 pu:2").unwrap();
        assert_eq!(t.nodes.len(), 1);
        let p = Placement::resolve(&t, &PlacementRequest::default()).unwrap();
        assert_eq!(p.numa_node, 0);
        assert_eq!(p.compute_cores, vec![0, 1]);
        assert_eq!(p.io_core, 1);
    }

    #[test]
    fn the_hwloc_and_sysfs_fixtures_of_two_packages_place_alike() {
        let dir = tempfile::tempdir().unwrap();
        for (n, list) in [(0, "0-63"), (1, "64-127")] {
            let d = dir.path().join(format!("devices/system/node/node{n}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), format!("{list}\n")).unwrap();
        }
        let sysfs = Topology::from_sysfs(dir.path()).unwrap();
        let hwloc = Topology::from_hwloc_synthetic(TWO_PACKAGES).unwrap();
        for numa_node in [None, Some(0), Some(1)] {
            let req = PlacementRequest { numa_node, threads: 8, ..Default::default() };
            let (from_hwloc, from_sysfs) = (Placement::resolve(&hwloc, &req), Placement::resolve(&sysfs, &req));
            assert_eq!(from_hwloc.unwrap(), from_sysfs.unwrap(), "{numa_node:?}");
        }
    }
}
