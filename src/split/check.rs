//! Offers checked against emission: a split offer stays only if emitting it realises it, so
//! the solver never sees a strategy codegen does not emit.

use super::Strategy;
use super::offer::LayerOffers;
use super::realise::Engine;

/// The most-split assignment of `o` with node `k` forced to option `j`: every other node its
/// `row` option, else its first, then nodes on a forbidden coupling fall back to `replicate`
/// (never node `k`). `None` when no such assignment holds every coupling.
pub fn forced_assignment(o: &LayerOffers, k: usize, j: usize) -> Option<Vec<usize>> {
    let strat = |v: usize, c: usize| o.nodes[v].options[c].strategy;
    let mut choice: Vec<usize> =
        o.nodes.iter().map(|n| n.options.iter().position(|x| x.strategy == Strategy::Row).unwrap_or(0)).collect();
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
    /// Withdraws from `o` (the offers of `layer` at degree `tp`) every split option whose
    /// forced assignment ([`forced_assignment`]) emission does not realise node by node;
    /// returns the withdrawn `(node, strategy)` pairs. `replicate` and the `rest` node's single
    /// option always stay.
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
                let ok = forced_assignment(o, k, j).is_some_and(|choice| {
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
                });
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
