//! The intra-layer problem of a layer at tensor degree t, built from what the tensor-split
//! engine ([`crate::split`]) offers: one problem node per choosing node with the engine's priced
//! strategies, and edges forbidding every pair the engine does not emit. The Megatron split
//! (maximal column/heads/row pairs, vocabulary-split embeddings) is one assignment of it; the
//! Megatron layer point is its evaluation, so the ILP's optimum is never slower.

use std::collections::HashMap;

use super::problem::{IntraEdge, IntraLayerProblem, IntraNode, NodeOption};
use crate::ir::LayeredGraph;
use crate::split::{self, LayerOffers, Strategy};

pub use crate::split::{GraphFacts, SplitGraph, StrategyInputs, analyse};

/// The intra-layer problem of one layer with what is needed to name its answer.
#[derive(Clone, Debug)]
pub struct LayerStrategies {
    /// The problem (`nodes` = the layer's choosing nodes in order, then one `rest` node).
    pub problem: IntraLayerProblem,
    /// Graph node indices (into the layer's node list) each problem node but the last names
    /// (one for matmuls and embeddings, the core matmuls for an attention core).
    pub members: Vec<Vec<usize>>,
    /// Parameter elements per device of each option, same shape as the problem's options.
    pub param_elems: Vec<Vec<f64>>,
    /// The strategy of each option, same shape as the problem's options.
    pub strategies: Vec<Vec<Strategy>>,
    /// The Megatron assignment.
    pub megatron: Vec<usize>,
}

/// Builds the intra-layer problem of `layer` at tensor degree `x.tp` (> 1).
pub fn build(lg: &LayeredGraph, layer: usize, x: &StrategyInputs<'_>) -> LayerStrategies {
    from_offers(split::offers(lg, layer, x))
}

/// [`build`] from a layer's analysed split structure.
pub fn build_from(lg: &LayeredGraph, layer: usize, sg: &SplitGraph, x: &StrategyInputs<'_>) -> LayerStrategies {
    from_offers(split::offers_from(lg, layer, sg, x))
}

/// The problem of a layer's offers.
pub fn from_offers(o: LayerOffers) -> LayerStrategies {
    let n = o.nodes.len();
    let mut members = Vec::with_capacity(n);
    let mut param_elems = Vec::with_capacity(n);
    let mut strategies = Vec::with_capacity(n);
    let mut nodes = Vec::with_capacity(n);
    for node in o.nodes {
        param_elems.push(node.options.iter().map(|x| x.param_elems).collect());
        strategies.push(node.options.iter().map(|x| x.strategy).collect::<Vec<_>>());
        let options = node
            .options
            .iter()
            .map(|x| NodeOption { name: x.strategy.to_string(), fwd_s: x.fwd_s, bwd_s: x.bwd_s, param_bytes: x.param_bytes, act_bytes: x.act_bytes, sync_s: 0.0 })
            .collect();
        members.push(node.members);
        nodes.push(IntraNode { name: node.name, options });
    }
    members.pop();
    let edges = o
        .couplings
        .iter()
        .map(|c| {
            let (a, b): (&Vec<Strategy>, &Vec<Strategy>) = (&strategies[c.from], &strategies[c.to]);
            let zero = vec![vec![0.0; b.len()]; a.len()];
            let mut forbidden = Vec::new();
            for (ka, &sa) in a.iter().enumerate() {
                for (kb, &sb) in b.iter().enumerate() {
                    if !c.allows(sa, sb) {
                        forbidden.push((ka, kb));
                    }
                }
            }
            IntraEdge { from: c.from, to: c.to, fwd_s: zero.clone(), bwd_s: zero, forbidden }
        })
        .collect();
    let problem = IntraLayerProblem { nodes, edges, memory_cap: None, act_weight: 1.0 };
    let megatron = megatron_assignment(&problem, &strategies);
    LayerStrategies { problem, members, param_elems, strategies, megatron }
}

/// The most-split feasible assignment: every node its first (most split) option, then nodes
/// whose edges forbid it fall back to `replicate` until every edge holds.
fn megatron_assignment(p: &IntraLayerProblem, strategies: &[Vec<Strategy>]) -> Vec<usize> {
    let mut choice: Vec<usize> = strategies.iter().map(|s| s.iter().position(|&o| o == Strategy::Row).unwrap_or(0)).collect();
    let replicate = |v: usize| strategies[v].iter().position(|&o| o == Strategy::Replicate);
    for _ in 0..=p.nodes.len() * 2 {
        let mut changed = false;
        for e in &p.edges {
            if e.forbidden.contains(&(choice[e.from], choice[e.to])) {
                // Give up the split on the side that has a replicate option and is split.
                for v in [e.from, e.to] {
                    if let Some(r) = replicate(v)
                        && choice[v] != r
                    {
                        choice[v] = r;
                        changed = true;
                        break;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    choice
}

impl LayerStrategies {
    /// Parameter elements per device of an assignment.
    pub fn params_of(&self, choice: &[usize]) -> f64 {
        choice.iter().zip(&self.param_elems).map(|(&k, p)| p.get(k).copied().unwrap_or(0.0)).sum()
    }

    /// The strategy of option `option` of problem node `node`.
    pub fn strategy(&self, node: usize, option: usize) -> Option<Strategy> {
        self.strategies.get(node)?.get(option).copied()
    }

    /// Strategy per graph node of the layer for an assignment: choosing nodes (weight
    /// matmuls, embeddings, attention-core matmuls) get their option, all others the `rest`
    /// node's (`follow`, or `sequence` under sequence parallelism).
    pub fn node_names(&self, lg: &LayeredGraph, layer: usize, choice: &[usize]) -> Vec<(String, Strategy)> {
        let lay = &lg.layers[layer];
        let rest = self.strategies.last().and_then(|s| s.first()).copied().unwrap_or(Strategy::Follow);
        let mut of: HashMap<usize, Strategy> = HashMap::new();
        for (k, m) in self.members.iter().enumerate() {
            let s = self.strategy(k, choice.get(k).copied().unwrap_or(0)).unwrap_or(Strategy::Replicate);
            for &i in m {
                of.insert(i, s);
            }
        }
        lay.nodes
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                let node = lg.graph.try_node(id).map(|n| n.name.clone()).unwrap_or_default();
                (node, of.get(&i).copied().unwrap_or(rest))
            })
            .collect()
    }
}
