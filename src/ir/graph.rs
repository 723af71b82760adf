//! The graph: nodes on a petgraph `StableDiGraph`, values in a table, typed ids for both.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::fmt;

use petgraph::Direction;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;

use super::{Attrs, Op, ParamRecord, Tensor, TensorType, Training};

/// A node's id; stable across removals of other nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(NodeIndex<u32>);

impl NodeId {
    /// The raw index (for dumps and dense side tables).
    pub fn index(self) -> usize {
        self.0.index()
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0.index())
    }
}

/// A value's id (index into the graph's value table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(u32);

impl ValueId {
    /// The raw index (for dense side tables).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// Where a value comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueKind {
    /// A graph input fed at run time.
    Input,
    /// A model initializer (a weight, or a model constant such as a RoPE table).
    Initializer,
    /// A constant made by a `Constant` node or by folding.
    Constant,
    /// The output of a node.
    Intermediate,
}

/// A tensor value flowing along the graph's edges.
#[derive(Clone, Debug)]
pub struct Value {
    /// ONNX name.
    pub name: String,
    /// Where it comes from.
    pub kind: ValueKind,
    /// Element type and shape, when known.
    pub ty: Option<TensorType>,
    /// The producing node, for intermediates.
    pub producer: Option<NodeId>,
    /// Constant data (initializers and folded constants).
    pub data: Option<Tensor>,
    /// What the export recorded this initializer stands for, if it did.
    pub record: Option<ParamRecord>,
    /// Whether this initializer is trained (set by `passes::params::decide`).
    pub training: Option<Training>,
}

/// One operator application.
#[derive(Clone, Debug)]
pub struct Node {
    /// ONNX node name (made unique on import).
    pub name: String,
    /// The operator.
    pub op: Op,
    /// Attributes.
    pub attrs: Attrs,
    /// Inputs; `None` for an omitted optional input.
    pub inputs: Vec<Option<ValueId>>,
    /// Outputs (omitted optional outputs are not listed).
    pub outputs: Vec<ValueId>,
    /// Module path from the exporter's metadata (`namespace`), if any.
    pub namespace: Option<String>,
    /// Position in the source file, used to break ties in execution order.
    pub order: u32,
}

/// Errors of graph construction and verification.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GraphError {
    /// Two values share one name.
    #[error("value `{0}` is defined twice")]
    DuplicateValue(String),
    /// A value is produced by two nodes.
    #[error("value `{value}` is produced by both node `{first}` and node `{second}`")]
    ProducedTwice { value: String, first: String, second: String },
    /// A cycle through the named node.
    #[error("the graph has a cycle through node `{0}`")]
    Cycle(String),
    /// A structural inconsistency found by the verifier.
    #[error("IR verifier: {0}")]
    Invalid(String),
}

/// A scalar graph output the training loss adds, times `coefficient`, to the loss it computes
/// from the main output (Hugging Face's `loss += router_aux_loss_coef · aux_loss`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AuxLoss {
    /// The graph output holding the loss of a microbatch (a mean over its tokens).
    pub output: ValueId,
    /// Its weight in the training loss.
    pub coefficient: f64,
}

/// A model graph.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    /// Graph name from the model.
    pub name: String,
    /// Opset version per domain (`""` is the default domain).
    pub opsets: BTreeMap<String, i64>,
    /// Graph inputs fed at run time, in model order.
    pub inputs: Vec<ValueId>,
    /// Graph outputs, in model order.
    pub outputs: Vec<ValueId>,
    /// Outputs that are auxiliary losses added to the training loss (a mixture of experts'
    /// load-balancing loss), as the export recorded them.
    pub aux_losses: Vec<AuxLoss>,
    dag: StableDiGraph<Node, ValueId, u32>,
    values: Vec<Value>,
    by_name: HashMap<String, ValueId>,
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Graph {
        Graph { name: name.into(), ..Graph::default() }
    }

    /// Adds a value; names must be unique.
    pub fn add_value(
        &mut self,
        name: impl Into<String>,
        kind: ValueKind,
        ty: Option<TensorType>,
        data: Option<Tensor>,
    ) -> Result<ValueId, GraphError> {
        let name = name.into();
        if self.by_name.contains_key(&name) {
            return Err(GraphError::DuplicateValue(name));
        }
        let id = ValueId(self.values.len() as u32);
        self.by_name.insert(name.clone(), id);
        self.values.push(Value { name, kind, ty, producer: None, data, record: None, training: None });
        Ok(id)
    }

    /// Renames a value; the new name must be free.
    pub fn rename_value(&mut self, id: ValueId, name: impl Into<String>) -> Result<(), GraphError> {
        let name = name.into();
        if self.by_name.contains_key(&name) {
            return Err(GraphError::DuplicateValue(name));
        }
        let old = std::mem::replace(&mut self.values[id.index()].name, name.clone());
        self.by_name.remove(&old);
        self.by_name.insert(name, id);
        Ok(())
    }

    /// Adds a node; its outputs must not have a producer yet. Wires the edges.
    pub fn add_node(&mut self, node: Node) -> Result<NodeId, GraphError> {
        for &out in &node.outputs {
            if let Some(p) = self.values[out.index()].producer {
                return Err(GraphError::ProducedTwice {
                    value: self.values[out.index()].name.clone(),
                    first: self.dag[p.0].name.clone(),
                    second: node.name.clone(),
                });
            }
        }
        let inputs: Vec<ValueId> = node.inputs.iter().flatten().copied().collect();
        let outputs = node.outputs.clone();
        let id = NodeId(self.dag.add_node(node));
        for out in outputs {
            let v = &mut self.values[out.index()];
            v.producer = Some(id);
            v.kind = ValueKind::Intermediate;
        }
        for input in inputs {
            if let Some(p) = self.values[input.index()].producer {
                self.dag.add_edge(p.0, id.0, input);
            }
        }
        Ok(id)
    }

    /// Removes a node; its outputs lose their producer.
    pub fn remove_node(&mut self, id: NodeId) -> Option<Node> {
        let node = self.dag.remove_node(id.0)?;
        for &out in &node.outputs {
            if self.values[out.index()].producer == Some(id) {
                self.values[out.index()].producer = None;
            }
        }
        Some(node)
    }

    /// Replaces a node by a constant: its (single) output becomes a `Constant` value.
    pub fn fold_to_constant(&mut self, id: NodeId, data: Tensor) -> Option<ValueId> {
        let node = self.remove_node(id)?;
        let out = *node.outputs.first()?;
        let v = &mut self.values[out.index()];
        v.kind = ValueKind::Constant;
        v.ty = Some(TensorType {
            dtype: data.dtype,
            shape: Some(super::Shape::from_known(&data.dims)),
        });
        v.data = Some(data);
        Some(out)
    }

    /// Points input `slot` of `node` at `value`, keeping edges consistent.
    pub fn set_input(&mut self, node: NodeId, slot: usize, value: Option<ValueId>) {
        let Some(n) = self.dag.node_weight_mut(node.0) else { return };
        if slot >= n.inputs.len() {
            n.inputs.resize(slot + 1, None);
        }
        n.inputs[slot] = value;
        self.rewire(node);
    }

    fn rewire(&mut self, node: NodeId) {
        let old: Vec<_> = self.dag.edges_directed(node.0, Direction::Incoming).map(|e| e.id()).collect();
        for e in old {
            self.dag.remove_edge(e);
        }
        let inputs: Vec<ValueId> = self.dag[node.0].inputs.iter().flatten().copied().collect();
        for input in inputs {
            if let Some(p) = self.values[input.index()].producer {
                self.dag.add_edge(p.0, node.0, input);
            }
        }
    }

    /// The node with this id. Panics on a removed id (an internal bug, never user input).
    pub fn node(&self, id: NodeId) -> &Node {
        &self.dag[id.0]
    }

    /// Mutable node access. Call [`Graph::set_input`] to change inputs so edges stay right.
    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.dag[id.0]
    }

    /// The node if it still exists.
    pub fn try_node(&self, id: NodeId) -> Option<&Node> {
        self.dag.node_weight(id.0)
    }

    /// The value with this id.
    pub fn value(&self, id: ValueId) -> &Value {
        &self.values[id.index()]
    }

    /// Mutable value access.
    pub fn value_mut(&mut self, id: ValueId) -> &mut Value {
        &mut self.values[id.index()]
    }

    /// Looks a value up by name.
    pub fn value_by_name(&self, name: &str) -> Option<ValueId> {
        self.by_name.get(name).copied()
    }

    /// All value ids (including dead ones).
    pub fn value_ids(&self) -> impl Iterator<Item = ValueId> + '_ {
        (0..self.values.len() as u32).map(ValueId)
    }

    /// Number of values in the table.
    pub fn value_count(&self) -> usize {
        self.values.len()
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.dag.node_count()
    }

    /// Node ids in storage order.
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.dag.node_indices().map(NodeId)
    }

    /// Nodes that consume an output of `id`.
    pub fn successors(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.dag.neighbors_directed(id.0, Direction::Outgoing).map(NodeId)
    }

    /// Nodes that produce an input of `id`.
    pub fn predecessors(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.dag.neighbors_directed(id.0, Direction::Incoming).map(NodeId)
    }

    /// For each value (by index), the nodes that read it, in execution order.
    pub fn uses(&self) -> Vec<Vec<NodeId>> {
        let mut uses = vec![Vec::new(); self.values.len()];
        if let Ok(order) = self.topo_order() {
            for id in order {
                for v in self.dag[id.0].inputs.iter().flatten() {
                    if uses[v.index()].last() != Some(&id) {
                        uses[v.index()].push(id);
                    }
                }
            }
        }
        uses
    }

    /// Execution order: topological, ties broken by position in the source file.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, GraphError> {
        let mut indegree: HashMap<NodeIndex<u32>, usize> = HashMap::new();
        for n in self.dag.node_indices() {
            indegree.insert(n, self.dag.edges_directed(n, Direction::Incoming).count());
        }
        let mut ready: BinaryHeap<Reverse<(u32, NodeIndex<u32>)>> = indegree
            .iter()
            .filter(|(_, d)| **d == 0)
            .map(|(n, _)| Reverse((self.dag[*n].order, *n)))
            .collect();
        let mut order = Vec::with_capacity(self.dag.node_count());
        while let Some(Reverse((_, n))) = ready.pop() {
            order.push(NodeId(n));
            for e in self.dag.edges_directed(n, Direction::Outgoing) {
                let t = e.target();
                if let Some(d) = indegree.get_mut(&t) {
                    *d -= 1;
                    if *d == 0 {
                        ready.push(Reverse((self.dag[t].order, t)));
                    }
                }
            }
        }
        if order.len() != self.dag.node_count() {
            let stuck = indegree
                .iter()
                .filter(|(_, d)| **d > 0)
                .map(|(n, _)| self.dag[*n].name.clone())
                .min()
                .unwrap_or_default();
            return Err(GraphError::Cycle(stuck));
        }
        Ok(order)
    }

    /// Initializer ids in value-table order.
    pub fn initializers(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.value_ids().filter(|&v| self.values[v.index()].kind == ValueKind::Initializer)
    }

    /// Checks structural invariants: producers match node outputs, inputs exist,
    /// edges match inputs, no cycles, graph outputs are defined.
    pub fn verify(&self) -> Result<(), GraphError> {
        for id in self.node_ids() {
            let node = self.node(id);
            for &out in &node.outputs {
                if self.value(out).producer != Some(id) {
                    return Err(GraphError::Invalid(format!(
                        "node `{}` lists output `{}` but is not its producer",
                        node.name,
                        self.value(out).name
                    )));
                }
            }
            let mut want: Vec<usize> = node
                .inputs
                .iter()
                .flatten()
                .filter_map(|v| self.value(*v).producer)
                .map(|p| p.index())
                .collect();
            let mut have: Vec<usize> = self.predecessors(id).map(|p| p.index()).collect();
            want.sort_unstable();
            have.sort_unstable();
            if want != have {
                return Err(GraphError::Invalid(format!("edges of node `{}` do not match its inputs", node.name)));
            }
            for v in node.inputs.iter().flatten() {
                let val = self.value(*v);
                if val.kind == ValueKind::Intermediate && val.producer.is_none() {
                    return Err(GraphError::Invalid(format!(
                        "node `{}` reads `{}`, which nothing produces",
                        node.name, val.name
                    )));
                }
            }
        }
        for &out in &self.outputs {
            let v = self.value(out);
            if v.kind == ValueKind::Intermediate && v.producer.is_none() {
                return Err(GraphError::Invalid(format!("graph output `{}` is not produced", v.name)));
            }
        }
        self.topo_order().map(|_| ())
    }
}
