//! Dead-node removal: nodes from which no graph output can be reached.

use crate::ir::{Graph, NodeId};

/// By node index: whether a graph output depends on the node.
pub fn live_nodes(graph: &Graph) -> Vec<bool> {
    let mut live = vec![false; graph.node_ids().map(|n| n.index() + 1).max().unwrap_or(0)];
    let mut stack: Vec<NodeId> = graph.outputs.iter().filter_map(|&v| graph.value(v).producer).collect();
    while let Some(n) = stack.pop() {
        if std::mem::replace(&mut live[n.index()], true) {
            continue;
        }
        stack.extend(graph.predecessors(n).filter(|p| !live[p.index()]));
    }
    live
}

/// Removes dead nodes; returns how many were removed.
pub fn remove_dead_nodes(graph: &mut Graph) -> usize {
    let live = live_nodes(graph);
    let dead: Vec<NodeId> = graph.node_ids().filter(|n| !live[n.index()]).collect();
    for &n in &dead {
        graph.remove_node(n);
    }
    dead.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, DType, Node, Op, OpKind, Shape, TensorType, ValueKind};

    fn f32ty(d: &[i64]) -> Option<TensorType> {
        Some(TensorType { dtype: DType::F32, shape: Some(Shape::from_known(d)) })
    }

    #[test]
    fn removes_only_nodes_that_reach_no_output() {
        let mut g = Graph::new("t");
        let x = g.add_value("x", ValueKind::Input, f32ty(&[2]), None).unwrap();
        let a = g.add_value("a", ValueKind::Intermediate, None, None).unwrap();
        let b = g.add_value("b", ValueKind::Intermediate, None, None).unwrap();
        let c = g.add_value("c", ValueKind::Intermediate, None, None).unwrap();
        let node = |name: &str, k, i: Vec<_>, o, order| Node {
            name: name.into(),
            op: Op::Known(k),
            attrs: Attrs::default(),
            inputs: i.into_iter().map(Some).collect(),
            outputs: vec![o],
            namespace: None,
            order,
        };
        g.add_node(node("relu", OpKind::Relu, vec![x], a, 0)).unwrap();
        g.add_node(node("dead_exp", OpKind::Exp, vec![a], b, 1)).unwrap();
        g.add_node(node("neg", OpKind::Neg, vec![a], c, 2)).unwrap();
        g.inputs = vec![x];
        g.outputs = vec![c];
        assert_eq!(remove_dead_nodes(&mut g), 1);
        let names: Vec<_> = g.node_ids().map(|n| g.node(n).name.clone()).collect();
        assert_eq!(names, vec!["relu", "neg"]);
        g.verify().unwrap();
    }
}
