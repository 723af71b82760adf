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

/// SMs DeepEP's dispatch and combine kernels hold while they run: its `Buffer.num_sms` default,
/// which Megatron-Core's `--moe-deepep-num-sms` also defaults to. Compute beside them runs on
/// the rest ([`ClusterSpec::compute_share_beside`]).
pub const DEEPEP_SMS: u32 = 20;
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
        let dpn = devices_per_node.max(1);
        let nodes = ranks.iter().max().map_or(0, |&r| r / dpn + 1);
        let mut per = vec![0usize; nodes];
        for &r in ranks {
            per[r / dpn] += 1;
        }
        GroupSpan { size: ranks.len(), per_node: per.into_iter().max().filter(|&n| n > 0).unwrap_or(1) }
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

    /// Dispatch (or combine) of routed tokens as DeepEP runs it, where each rank holds
    /// `tokens_bytes` of tokens, each routed to `top_k` of `experts` experts spread evenly over
    /// the group: a token crosses the network once per other node holding one of its experts,
    /// and NVLink carries its copies to the experts' ranks inside each node, the two links at
    /// once. With uniform routing a node holding E/m of the E experts is hit with probability
    /// 1 − C(E − E/m, k)/C(E, k) ([`nodes_hit`]).
    pub fn per_node_dispatch(&self, tokens_bytes: f64, experts: usize, top_k: usize, group: &GroupSpan) -> f64 {
        let n = group.size;
        if n <= 1 || tokens_bytes <= 0.0 || experts == 0 {
            return 0.0;
        }
        let per_node = group.per_node.clamp(1, n);
        let nodes = n.div_ceil(per_node);
        let k = top_k.clamp(1, experts);
        // copies a token sends inside its own node: its experts on the other local ranks
        let intra_pairs = k as f64 * (per_node - 1) as f64 / n as f64;
        let intra = tokens_bytes * intra_pairs / self.intra.bandwidth;
        if nodes <= 1 {
            return intra + (per_node - 1) as f64 * self.intra.latency;
        }
        let remote_nodes = (nodes - 1) as f64 * nodes_hit(experts, experts / nodes, k);
        // pairs on remote nodes arrive over the network once per node, then fan out over NVLink
        let forwarded = k as f64 * (n - per_node) as f64 / n as f64 - remote_nodes;
        let inter = tokens_bytes * remote_nodes / self.inter.bandwidth;
        let fan_out = tokens_bytes * forwarded.max(0.0) / self.intra.bandwidth;
        inter.max(intra + fan_out) + (nodes - 1) as f64 * self.inter.latency
    }

    /// Pipelined ring broadcast: B/bw + (n−1)α on the slowest link spanned.
    pub fn broadcast(&self, bytes: f64, group: &GroupSpan) -> f64 {
        if group.size <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        self.link(group.link_kind()).time(bytes, (group.size - 1) as f64)
    }
}

/// The probability that a token routed to `k` distinct experts of `experts` hits at least one
/// of `held` given experts: 1 − C(E − held, k)/C(E, k).
pub fn nodes_hit(experts: usize, held: usize, k: usize) -> f64 {
    if held == 0 || k == 0 {
        return 0.0;
    }
    if held + k > experts {
        return 1.0;
    }
    // C(E − h, k)/C(E, k) = Π_{i<k} (E − h − i)/(E − i)
    let miss: f64 = (0..k).map(|i| (experts - held - i) as f64 / (experts - i) as f64).product();
    1.0 - miss
}

/// The expected load of the busiest of an expert group's `ranks` ranks over the mean when each
/// routed pair lands on an expert uniformly at random (an engine's forced load balancing),
/// `pairs` the mean a rank receives. The loads are multinomial: each is the mean plus an
/// independent draw of variance `pairs` less the draws' average (they sum to the total), so the
/// busiest lies E[max of `ranks` standard normals] · √pairs above the mean.
pub fn uniform_routing_imbalance(ranks: usize, pairs: f64) -> f64 {
    if ranks <= 1 || pairs <= 0.0 {
        return 1.0;
    }
    1.0 + expected_max_of_normals(ranks) / pairs.sqrt()
}

/// E[max of `n` independent standard normals] = ∫ x · n φ(x) Φ(x)^(n−1) dx, by the midpoint
/// rule over ±10 (Φ from erfc, Abramowitz and Stegun 7.1.26, error under 1.5e-7).
fn expected_max_of_normals(n: usize) -> f64 {
    let phi = |x: f64| (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let cdf = |x: f64| {
        let z = x.abs() / std::f64::consts::SQRT_2;
        let t = 1.0 / (1.0 + 0.3275911 * z);
        let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
        let tail = 0.5 * poly * (-z * z).exp();
        if x >= 0.0 { 1.0 - tail } else { tail }
    };
    let (steps, lo, hi) = (20_000, -10.0, 10.0);
    let dx = (hi - lo) / steps as f64;
    (0..steps).map(|i| lo + (i as f64 + 0.5) * dx).map(|x| x * n as f64 * phi(x) * cdf(x).powi(n as i32 - 1) * dx).sum()
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

    /// Every k-subset of `experts`, as bit masks.
    fn subsets(experts: usize, k: usize) -> Vec<u32> {
        (0u32..1 << experts).filter(|m| m.count_ones() as usize == k).collect()
    }

    #[test]
    fn nodes_hit_equals_enumeration() {
        for (experts, held, k) in [(8, 2, 2), (8, 2, 3), (12, 3, 4), (12, 6, 2), (10, 1, 1), (9, 3, 7), (6, 6, 2)] {
            let all = subsets(experts, k);
            let held_mask = (1u32 << held) - 1;
            let hit = all.iter().filter(|&&m| m & held_mask != 0).count() as f64 / all.len() as f64;
            assert!((nodes_hit(experts, held, k) - hit).abs() < 1e-12, "E {experts} held {held} k {k}");
        }
    }

    #[test]
    fn per_node_dispatch_sends_each_token_once_per_node() {
        let spec = ClusterSpec::parse("h100-80gb:256").unwrap();
        let comm = CommModel::new(&spec);
        // 128 experts top 8 over an expert group of 8 ranks on 4 nodes (2 per node)
        let group = GroupSpan { size: 8, per_node: 2 };
        let tokens = 1e9;
        let pairs = comm.all_to_all(8.0 * tokens, &group);
        let per_node = comm.per_node_dispatch(tokens, 128, 8, &group);
        // the network carries 3 remote nodes × P(hit) copies instead of 8 × 6/8 pairs
        let remote = 3.0 * nodes_hit(128, 32, 8);
        let network = tokens * remote / comm.inter.bandwidth;
        assert!(per_node >= network && per_node < network * 1.01, "{per_node} vs {network}");
        let saved = 6.0 / remote;
        assert!(saved > 2.0 && saved < 2.3, "{saved}");
        assert!(per_node < pairs / 2.0, "{per_node} vs {pairs}");
        // inside one node nothing crosses the network: the pairs on the other local ranks
        let node = GroupSpan { size: 8, per_node: 8 };
        let local = comm.per_node_dispatch(tokens, 128, 8, &node);
        assert!((local - comm.all_to_all(8.0 * tokens, &node)).abs() < 1e-9 * local, "{local}");
    }
}
