//! Communication cost: alpha-beta models of collectives on the links a group spans.
//!
//! A group of n ranks with k of them on each node spans one node (k = n: NVLink only) or
//! n/k nodes (the network). Crossing nodes, a collective costs the cheaper of a flat ring
//! (every step paced by the network) and the hierarchical form (intra-node reduce-scatter,
//! inter-node collective on 1/k of the data between the ranks of equal local index, intra-node
//! all-gather), as NCCL's tree/ring choice approximates.
//!
//! Byte conventions: `all_reduce(B)` and `broadcast(B)` — the buffer each rank holds;
//! `all_gather(B)` — the gathered output (each rank contributes B/n); `reduce_scatter(B)` —
//! the input each rank holds (each keeps B/n); `all_to_all(B)` — what each rank sends in total.

use super::ClusterSpec;
use super::cluster::CollectiveLinks;
pub use super::link::Link;

/// Which link a transfer or group uses (spelled `intra-node`, `inter-node` in plan files).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkKind {
    /// Inside a node (NVLink; shared memory on `cpu`).
    IntraNode,
    /// Between nodes (the network).
    InterNode,
}

impl LinkKind {
    /// Lower-case name for reports (`intra-node`, `inter-node`).
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::IntraNode => "intra-node",
            LinkKind::InterNode => "inter-node",
        }
    }
}

/// The shape of a process group on the cluster: `size` ranks, `per_node` of them on each node
/// they touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupSpan {
    /// Ranks in the group.
    pub size: usize,
    /// Ranks of the group per node (size when the group fits in one node).
    pub per_node: usize,
}

impl GroupSpan {
    /// A group inside one node.
    pub fn intra_node(size: usize) -> GroupSpan {
        GroupSpan { size, per_node: size.max(1) }
    }

    /// The group {first + i·stride | i < size} on nodes of `devices_per_node` consecutive ranks.
    /// `per_node` is the largest number of members on one node.
    pub fn strided(first: usize, size: usize, stride: usize, devices_per_node: usize) -> GroupSpan {
        let dpn = devices_per_node.max(1);
        let mut per_node = 0;
        let mut current: Option<usize> = None;
        let mut run = 0;
        for i in 0..size {
            let node = (first + i * stride) / dpn;
            if current == Some(node) {
                run += 1;
            } else {
                current = Some(node);
                run = 1;
            }
            per_node = per_node.max(run);
        }
        GroupSpan { size, per_node: per_node.max(1) }
    }

    /// The group of explicit global ranks.
    pub fn of_ranks(ranks: &[usize], devices_per_node: usize) -> GroupSpan {
        let mut per: std::collections::BTreeMap<usize, usize> = Default::default();
        for &r in ranks {
            *per.entry(r / devices_per_node.max(1)).or_default() += 1;
        }
        GroupSpan { size: ranks.len(), per_node: per.values().copied().max().unwrap_or(1) }
    }

    /// Nodes the group touches.
    pub fn nodes(&self) -> usize {
        self.size.div_ceil(self.per_node.max(1))
    }

    /// The slowest link the group uses.
    pub fn link_kind(&self) -> LinkKind {
        if self.nodes() <= 1 { LinkKind::IntraNode } else { LinkKind::InterNode }
    }
}

/// Alpha-beta cost model of a cluster's links.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CommModel {
    /// The intra-node link.
    pub intra: Link,
    /// The inter-node link.
    pub inter: Link,
    /// Devices per node.
    pub devices_per_node: usize,
    /// Measured per-collective links that replace `intra` for that collective (`cpu` with a
    /// calibration file: Gloo's collectives cost far more per call than a message).
    pub collectives: Option<CollectiveLinks>,
}

impl CommModel {
    /// The model of a cluster spec.
    pub fn new(spec: &ClusterSpec) -> CommModel {
        CommModel {
            intra: Link { bandwidth: spec.intra_node_bandwidth, latency: spec.intra_node_latency },
            inter: Link { bandwidth: spec.inter_node_bandwidth, latency: spec.inter_node_latency },
            devices_per_node: spec.devices_per_node.max(1),
            collectives: spec.collectives,
        }
    }

    /// The intra-node link of each collective: measured where calibrated, else `intra`.
    fn intra_for(&self, pick: fn(&CollectiveLinks) -> Link) -> Link {
        self.collectives.as_ref().map_or(self.intra, pick)
    }

    /// The link of a kind.
    pub fn link(&self, kind: LinkKind) -> Link {
        match kind {
            LinkKind::IntraNode => self.intra,
            LinkKind::InterNode => self.inter,
        }
    }

    /// The link between two global ranks.
    pub fn link_between(&self, a: usize, b: usize) -> LinkKind {
        if a / self.devices_per_node == b / self.devices_per_node {
            LinkKind::IntraNode
        } else {
            LinkKind::InterNode
        }
    }

    /// Point-to-point transfer of `bytes`: α + B/bw.
    pub fn p2p(&self, bytes: f64, link: LinkKind) -> f64 {
        self.link(link).time(bytes, 1.0)
    }

    /// Ring all-reduce: 2(n−1)/n·B/bw + 2(n−1)α; hierarchical across nodes where cheaper.
    pub fn all_reduce(&self, bytes: f64, group: &GroupSpan) -> f64 {
        let n = group.size;
        if n <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let ring = |link: Link, n: usize, b: f64| {
            let n_f = n as f64;
            link.time(2.0 * (n_f - 1.0) / n_f * b, 2.0 * (n_f - 1.0))
        };
        let intra = self.intra_for(|c| c.all_reduce);
        if group.nodes() <= 1 {
            return ring(intra, n, bytes);
        }
        let flat = ring(self.inter, n, bytes);
        let k = group.per_node;
        if k <= 1 {
            return flat;
        }
        let nodes = group.nodes();
        let half = |link: Link, n: usize, b: f64| {
            let n_f = n as f64;
            link.time((n_f - 1.0) / n_f * b, n_f - 1.0)
        };
        let hier = 2.0 * half(intra, k, bytes) + ring(self.inter, nodes, bytes / k as f64);
        flat.min(hier)
    }

    /// Ring all-gather of a `bytes` output: (n−1)/n·B/bw + (n−1)α; hierarchical across nodes
    /// where cheaper.
    pub fn all_gather(&self, bytes: f64, group: &GroupSpan) -> f64 {
        self.ring_half(bytes, group, self.intra_for(|c| c.all_gather))
    }

    /// Ring reduce-scatter of a `bytes` input: the mirror of [`CommModel::all_gather`], on its
    /// own measured link where calibrated.
    pub fn reduce_scatter(&self, bytes: f64, group: &GroupSpan) -> f64 {
        self.ring_half(bytes, group, self.intra_for(|c| c.reduce_scatter))
    }

    /// Half a ring (all-gather or reduce-scatter) of `bytes` with `intra` inside nodes.
    fn ring_half(&self, bytes: f64, group: &GroupSpan, intra: Link) -> f64 {
        let n = group.size;
        if n <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let n_f = n as f64;
        if group.nodes() <= 1 {
            return intra.time((n_f - 1.0) / n_f * bytes, n_f - 1.0);
        }
        let flat = self.inter.time((n_f - 1.0) / n_f * bytes, n_f - 1.0);
        let k = group.per_node as f64;
        if group.per_node <= 1 {
            return flat;
        }
        let nodes = group.nodes() as f64;
        // Inter-node gather of the pieces of equal local index, then intra-node gather.
        let hier = self.inter.time((nodes - 1.0) / n_f * bytes, nodes - 1.0) + intra.time((k - 1.0) / k * bytes, k - 1.0);
        flat.min(hier)
    }

    /// All-to-all where each rank sends `bytes` in total, B/n to each peer: the intra-node
    /// share over NVLink, the rest over the network, (n−1) messages.
    pub fn all_to_all(&self, bytes: f64, group: &GroupSpan) -> f64 {
        let n = group.size;
        if n <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let n_f = n as f64;
        let k = group.per_node.min(n) as f64;
        let intra = (k - 1.0) / n_f * bytes / self.intra.bandwidth;
        let inter = (n_f - k) / n_f * bytes / self.inter.bandwidth;
        let alpha = if group.nodes() > 1 { self.inter.latency } else { self.intra.latency };
        intra + inter + (n_f - 1.0) * alpha
    }

    /// Pipelined ring broadcast: B/bw + (n−1)α on the slowest link spanned.
    pub fn broadcast(&self, bytes: f64, group: &GroupSpan) -> f64 {
        if group.size <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        self.link(group.link_kind()).time(bytes, (group.size - 1) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_of_strided_groups() {
        // 8 devices per node: tp group of 8 consecutive ranks stays in a node.
        assert_eq!(GroupSpan::strided(0, 8, 1, 8), GroupSpan { size: 8, per_node: 8 });
        // stride 8: one rank per node.
        assert_eq!(GroupSpan::strided(3, 4, 8, 8).per_node, 1);
        // stride 2 over 16 ranks: 4 per node, 4 nodes.
        let g = GroupSpan::strided(0, 16, 2, 8);
        assert_eq!((g.per_node, g.nodes()), (4, 4));
        assert_eq!(GroupSpan::of_ranks(&[0, 1, 8, 9], 8), GroupSpan { size: 4, per_node: 2 });
    }
}
