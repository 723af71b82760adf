//! Offers checked against emission: a split offer stays only if emitting it realises it, so
//! the solver never sees a strategy codegen does not emit.

use super::Strategy;
use super::offer::LayerOffers;
use super::realise::Engine;

/// The most-split assignment of `o` with node `k` forced to option `j`: every other node its
/// `row` option, else its first, then nodes on a forbidden coupling fall back to `replicate`
/// (never node `k`). `None` when no such assignment holds every coupling.
pub fn forced_assignment(o: &LayerOffers, k: usize, j: usize) -> Option<Vec<usize>> {
    forced_within(o, k, j, false)
}

/// [`forced_assignment`] with every node outside `k`'s coupling component `replicate`: checks
/// an offer on its own, so that it is not withdrawn because another, uncoupled part of the
/// layer cannot split.
pub fn isolated_assignment(o: &LayerOffers, k: usize, j: usize) -> Option<Vec<usize>> {
    forced_within(o, k, j, true)
}

/// Nodes coupled to `k`, directly or through other couplings (`k` included).
fn component(o: &LayerOffers, k: usize) -> Vec<bool> {
    let mut inside = vec![false; o.nodes.len()];
    let mut stack = vec![k];
    while let Some(v) = stack.pop() {
        if std::mem::replace(&mut inside[v], true) {
            continue;
        }
        for c in &o.couplings {
            if c.from == v && !inside[c.to] {
                stack.push(c.to);
            }
            if c.to == v && !inside[c.from] {
                stack.push(c.from);
            }
        }
    }
    inside
}

fn forced_within(o: &LayerOffers, k: usize, j: usize, isolate: bool) -> Option<Vec<usize>> {
    let strat = |v: usize, c: usize| o.nodes[v].options[c].strategy;
    let inside = if isolate && k < o.nodes.len() { component(o, k) } else { vec![true; o.nodes.len()] };
    let mut choice: Vec<usize> = o
        .nodes
        .iter()
        .zip(&inside)
        .map(|(n, &inside)| {
            let pick = if inside { Strategy::Row } else { Strategy::Replicate };
            n.options.iter().position(|x| x.strategy == pick).unwrap_or(0)
        })
        .collect();
    *choice.get_mut(k)? = j;
    for _ in 0..=2 * o.nodes.len() + 1 {
        let mut changed = false;
        for c in &o.couplings {
            if c.allows(strat(c.from, choice[c.from]), strat(c.to, choice[c.to])) {
                continue;
            }
            let fix = [c.to, c.from].into_iter().filter(|&v| v != k).find_map(|v| {
                let r = o.nodes[v].options.iter().position(|x| x.strategy == Strategy::Replicate)?;
                (choice[v] != r).then_some((v, r))
            });
            let (v, r) = fix?;
            choice[v] = r;
            changed = true;
        }
        if !changed {
            return Some(choice);
        }
    }
    None
}

impl Engine<'_> {
    /// Withdraws from `o` (the offers of `layer` at degree `tp`) every split option that
    /// emission realises node by node neither in its forced assignment ([`forced_assignment`])
    /// nor with the rest of the layer replicated ([`isolated_assignment`]); returns the
    /// withdrawn `(node, strategy)` pairs. `replicate` and the `rest` node's single option
    /// always stay. (Codegen checks realised == chosen again for the assignment the solver
    /// picks.)
    pub fn check_offers(&self, layer: usize, tp: usize, o: &mut LayerOffers) -> Vec<(usize, Strategy)> {
        let Some(lay) = self.lg.layers.get(layer) else { return Vec::new() };
        let g = &self.lg.graph;
        let last = o.nodes.len().saturating_sub(1);
        let mut withdrawn = Vec::new();
        for k in 0..last {
            for j in 0..o.nodes[k].options.len() {
                let s = o.nodes[k].options[j].strategy;
                if !s.is_split() {
                    continue;
                }
                let realises = |choice: Vec<usize>| {
                    let chosen: Vec<(String, Strategy)> = (0..last)
                        .flat_map(|v| {
                            let sv = o.nodes[v].options[choice[v]].strategy;
                            o.nodes[v].members.iter().filter_map(move |&i| lay.nodes.get(i)).map(move |&n| (g.node(n).name.clone(), sv))
                        })
                        .collect();
                    let keep: Vec<String> = chosen.iter().filter(|(_, s)| *s == Strategy::Replicate).map(|(n, _)| n.clone()).collect();
                    self.plan_keeping(layer, tp, &keep).is_ok_and(|(_, realised)| {
                        chosen.iter().all(|(n, want)| realised.iter().find(|(m, _)| m == n).map_or(Strategy::Follow, |x| x.1) == *want)
                    })
                };
                let ok = forced_assignment(o, k, j).is_some_and(realises)
                    || isolated_assignment(o, k, j).filter(|c| Some(c) != forced_assignment(o, k, j).as_ref()).is_some_and(realises);
                if !ok {
                    withdrawn.push((k, s));
                }
            }
        }
        for &(k, s) in &withdrawn {
            o.nodes[k].options.retain(|x| x.strategy != s);
        }
        withdrawn
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::split::offer::{Coupling, NodeOffers, Offer};

    fn node(name: &str, options: &[Strategy]) -> NodeOffers {
        let offer = |strategy| Offer { strategy, fwd_s: 0.0, bwd_s: 0.0, param_elems: 0.0, param_bytes: 0.0, act_bytes: 0.0 };
        NodeOffers { name: name.into(), members: Vec::new(), options: options.iter().map(|&s| offer(s)).collect() }
    }

    /// Two column/row pairs (attention-like and MLP-like) and the rest.
    fn two_pairs() -> LayerOffers {
        use Strategy::*;
        let pair = |from, to| Coupling { from, to, split_from: Column, split_to: Row };
        LayerOffers {
            nodes: vec![
                node("a", &[Column, Replicate]),
                node("b", &[Row, Replicate]),
                node("c", &[Column, Replicate]),
                node("d", &[Row, Replicate]),
                node("rest", &[Follow]),
            ],
            couplings: vec![pair(0, 1), pair(2, 3)],
        }
    }

    #[test]
    fn forced_splits_everything_isolated_only_the_component() {
        let o = two_pairs();
        // Forcing c's column: the most-split assignment splits both pairs.
        assert_eq!(forced_assignment(&o, 2, 0), Some(vec![0, 0, 0, 0, 0]));
        // Isolated: a and b (another component) replicate, d follows c.
        assert_eq!(isolated_assignment(&o, 2, 0), Some(vec![1, 1, 0, 0, 0]));
        // Forcing c's replicate: its row consumer d falls back to replicate too.
        assert_eq!(isolated_assignment(&o, 2, 1), Some(vec![1, 1, 1, 1, 0]));
    }
}
