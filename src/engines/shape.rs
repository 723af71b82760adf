//! What an engine's model flags need, read from the analysed graph: the layer roles (the
//! layers before the first transformer block are the engines' embedding, those after the last
//! their head and loss), and the transformer's sizes where the graph shows them (hidden size,
//! vocabulary, heads and query groups, MLP width, experts, norm, activation, positions,
//! biases, tied embedding).

use crate::ir::{Graph, LayerKind, LayeredGraph, NodeId, OpKind, ValueId, ValueKind};

/// Normalisation of the transformer layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norm {
    /// `LayerNormalization` (GPT).
    LayerNorm,
    /// Root-mean-square norm (Llama).
    RmsNorm,
}

/// The MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mlp {
    /// GELU on one up projection (GPT).
    Gelu,
    /// SiLU-gated (SwiGLU: gate and up projections, Llama).
    SwiGlu,
}

/// How positions enter the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Positions {
    /// A learned table of this many positions, added to the token embedding (GPT).
    Learned(u64),
    /// Rotary embeddings inside attention (Llama).
    Rope,
    /// Neither was found.
    Unknown,
}

/// The model as the engines' flags describe it.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    /// The role of every layer of `graph`, in order.
    pub kinds: Vec<LayerKind>,
    /// Transformer blocks (the engines' layers).
    pub blocks: usize,
    /// Index of the first and last block.
    pub block_range: Option<[usize; 2]>,
    /// The layer that breaks embedding → blocks → head, if one does: (index, name).
    pub misplaced: Option<(usize, String)>,
    /// Sequence length: the second dim of the integer token input, after binding.
    pub seq: Option<u64>,
    /// Hidden size (the token embedding's width).
    pub hidden: Option<u64>,
    /// Vocabulary (the token embedding's rows).
    pub vocab: Option<u64>,
    /// Attention heads.
    pub heads: Option<u64>,
    /// Key/value heads (query groups); equal to `heads` without grouped-query attention.
    pub kv_heads: Option<u64>,
    /// Channels per head.
    pub head_dim: Option<u64>,
    /// The first block's MLP width (one expert's, where that block is a mixture of experts).
    pub ffn: Option<u64>,
    /// Experts per mixture-of-experts layer (of the first block that has them).
    pub experts: Option<u64>,
    /// One expert's MLP width.
    pub expert_ffn: Option<u64>,
    /// Dense blocks before the first mixture of experts (DeepSeek-V3's first three; 0 where
    /// every block has experts, or none does).
    pub dense_blocks: usize,
    /// Experts each token is routed to.
    pub top_k: Option<u64>,
    /// The blocks' norm.
    pub norm: Option<Norm>,
    /// The MLP's activation.
    pub mlp: Option<Mlp>,
    /// Position encoding.
    pub positions: Positions,
    /// Whether the head reads the token embedding's weight.
    pub tied_embedding: bool,
    /// Whether the blocks' linear layers add biases.
    pub linear_bias: bool,
    /// Each layer's parameter elements (DeepSpeed's `parameters` partition weighs by them).
    pub layer_params: Vec<u64>,
}

fn dims(g: &Graph, v: ValueId) -> Option<Vec<i64>> {
    g.value(v).ty.as_ref()?.shape.as_ref()?.known()
}

fn is_init(g: &Graph, v: ValueId) -> bool {
    g.value(v).kind == ValueKind::Initializer
}

fn kind(g: &Graph, n: NodeId) -> Option<OpKind> {
    g.try_node(n)?.op.kind()
}

impl ModelShape {
    /// Reads the shape of `lg`.
    pub fn of(lg: &LayeredGraph) -> ModelShape {
        let g = &lg.graph;
        let kinds: Vec<LayerKind> = lg.layers.iter().map(|l| l.kind).collect();
        let first = kinds.iter().position(|&k| k == LayerKind::Block);
        let last = kinds.iter().rposition(|&k| k == LayerKind::Block);
        let block_range = first.zip(last).map(|(a, b)| [a, b]);
        let misplaced = block_range.and_then(|[a, b]| (a..=b).find(|&l| kinds[l] != LayerKind::Block)).map(|l| (l, lg.layers[l].name.clone()));
        let layer_params = lg
            .layers
            .iter()
            .map(|l| l.params.iter().map(|&p| dims(g, p).map_or(0, |d| d.iter().product::<i64>().max(0) as u64)).sum())
            .collect();
        let mut shape = ModelShape {
            blocks: kinds.iter().filter(|&&k| k == LayerKind::Block).count(),
            kinds,
            block_range,
            misplaced,
            seq: lg.graph.inputs.iter().find_map(|&v| {
                let t = g.value(v).ty.as_ref()?;
                let d = t.shape.as_ref()?;
                (t.dtype.is_int() && d.rank() == 2).then(|| d.0[1].known()).flatten().map(|s| s as u64)
            }),
            hidden: None,
            vocab: None,
            heads: None,
            kv_heads: None,
            head_dim: None,
            ffn: None,
            experts: None,
            expert_ffn: None,
            dense_blocks: 0,
            top_k: None,
            norm: None,
            mlp: None,
            positions: Positions::Unknown,
            tied_embedding: false,
            linear_bias: false,
            layer_params,
        };
        let Some([first, last]) = block_range else { return shape };
        shape.read_embedding(lg, first);
        shape.read_block(lg, first);
        // models whose first blocks are dense (DeepSeek-V3): the experts of the first block with them
        if shape.experts.is_none()
            && let Some(b) = (first..=last).find(|&l| lg.layers[l].nodes.iter().any(|&n| kind(g, n) == Some(OpKind::MixtureOfExperts)))
        {
            let mut moe = shape.clone();
            moe.read_block(lg, b);
            (shape.experts, shape.top_k, shape.expert_ffn) = (moe.experts, moe.top_k, moe.expert_ffn);
            shape.dense_blocks = shape.kinds[first..b].iter().filter(|&&k| k == LayerKind::Block).count();
        }
        // The head (after the last block) reads a weight an earlier layer owns: the tied table.
        shape.tied_embedding = lg.layers[last + 1..].iter().any(|l| !l.shared_params.is_empty());
        shape
    }

    /// Vocabulary and hidden size from the token table, positions from a second table.
    fn read_embedding(&mut self, lg: &LayeredGraph, first_block: usize) {
        let g = &lg.graph;
        for layer in &lg.layers[..first_block] {
            for &n in &layer.nodes {
                if kind(g, n) != Some(OpKind::Gather) {
                    continue;
                }
                let node = g.node(n);
                let (Some(Some(table)), Some(Some(index))) = (node.inputs.first(), node.inputs.get(1)) else { continue };
                let Some([rows, cols]) = dims(g, *table).and_then(|d| <[i64; 2]>::try_from(d).ok()) else { continue };
                if !is_init(g, *table) {
                    continue;
                }
                if from_input(g, *index) && self.vocab.is_none() {
                    self.vocab = Some(rows as u64);
                    self.hidden = Some(cols as u64);
                } else if self.positions == Positions::Unknown {
                    self.positions = Positions::Learned(rows as u64);
                }
            }
        }
    }

    /// Heads, MLP width, experts, norm, activation and biases from the first block.
    fn read_block(&mut self, lg: &LayeredGraph, block: usize) {
        let g = &lg.graph;
        let nodes = &lg.layers[block].nodes;
        let mut head_splits: Vec<(u64, u64)> = Vec::new();
        let mut down_rows: Vec<u64> = Vec::new();
        let mut up_projections = 0usize;
        for &n in nodes {
            let Some(k) = kind(g, n) else { continue };
            let node = g.node(n);
            let input = |i: usize| node.inputs.get(i).copied().flatten();
            match k {
                // [b, s, h] → [b, s, heads, d]: the split of q, k and v into heads
                OpKind::Reshape => {
                    let (Some(x), Some(&y)) = (input(0), node.outputs.first()) else { continue };
                    if let (Some(xd), Some(yd)) = (dims(g, x).or_else(|| rank_only(g, x)), dims(g, y).or_else(|| rank_only(g, y)))
                        && xd.len() == 3
                        && yd.len() == 4
                        && yd[2] > 0
                        && yd[3] > 0
                    {
                        head_splits.push((yd[2] as u64, yd[3] as u64));
                    }
                }
                OpKind::MatMul | OpKind::Gemm => {
                    let Some(w) = input(1).filter(|&w| is_init(g, w)) else { continue };
                    // Gemm's third input: the bias (a Conv1D or Linear exported as addmm)
                    self.linear_bias |= k == OpKind::Gemm && input(2).is_some_and(|b| is_init(g, b));
                    if let Some([rows, cols]) = dims(g, w).and_then(|d| <[i64; 2]>::try_from(d).ok())
                        && let Some(h) = self.hidden
                    {
                        if cols as u64 == h && rows as u64 != h {
                            down_rows.push(rows as u64);
                        }
                        if rows as u64 == h && cols as u64 != h && cols as u64 > h {
                            up_projections += 1;
                        }
                    }
                }
                OpKind::Add => {
                    // a bias: a rank-1 initializer added to a matmul's output
                    let from_matmul = node.inputs.iter().flatten().any(|&v| g.value(v).producer.is_some_and(|p| kind(g, p) == Some(OpKind::MatMul)));
                    let bias = node.inputs.iter().flatten().any(|&v| is_init(g, v) && dims(g, v).is_some_and(|d| d.len() == 1));
                    self.linear_bias |= from_matmul && bias;
                }
                OpKind::LayerNormalization => self.norm = Some(Norm::LayerNorm),
                OpKind::RMSNormalization if self.norm.is_none() => self.norm = Some(Norm::RmsNorm),
                OpKind::ReduceMean if self.norm.is_none() => self.norm = Some(Norm::RmsNorm),
                OpKind::Gelu | OpKind::Erf | OpKind::Tanh if self.mlp.is_none() => self.mlp = Some(Mlp::Gelu),
                OpKind::Sigmoid | OpKind::SwiGlu => self.mlp = Some(Mlp::SwiGlu),
                OpKind::Sin | OpKind::Cos => self.positions = rope_if_unknown(self.positions),
                OpKind::TopK => {
                    if let Some(k) = input(1).and_then(|v| g.value(v).data.as_ref()).and_then(|t| t.to_i64_vec()).and_then(|v| v.first().copied()) {
                        self.top_k = Some(k as u64);
                    }
                }
                OpKind::MixtureOfExperts => {
                    self.experts = Some(node.attrs.int("experts", 0).max(0) as u64).filter(|&e| e > 0);
                    // gate_up [E, 2F, H]
                    if let Some(d) = input(3).and_then(|w| dims(g, w))
                        && d.len() == 3
                    {
                        self.ffn = Some((d[1] / 2) as u64);
                        self.expert_ffn = self.ffn;
                    }
                    self.mlp = Some(Mlp::SwiGlu);
                }
                _ => {}
            }
        }
        if let Some(&(heads, d)) = head_splits.iter().max() {
            self.heads = Some(heads);
            self.head_dim = Some(d);
            self.kv_heads = head_splits.iter().map(|&(h, _)| h).min();
        }
        if self.ffn.is_none() {
            // the MLP's down projection is the block's last product into the hidden size; the
            // attention's output projection comes before it (with values narrower than the
            // queries, as latent attention's, its rows are not heads · head_dim)
            let attention_out = self.heads.zip(self.head_dim).map(|(a, d)| a * d);
            self.ffn = down_rows.into_iter().filter(|&r| Some(r) != attention_out).last();
        }
        if self.mlp == Some(Mlp::Gelu) && up_projections >= 2 {
            self.mlp = Some(Mlp::SwiGlu);
        }
        // RoPE tables folded into initializers read by the block (no Sin/Cos nodes left)
        if self.positions == Positions::Unknown
            && nodes.iter().any(|&n| {
                g.try_node(n).is_some_and(|node| {
                    node.inputs.iter().flatten().any(|&v| is_init(g, v) && matches!(g.value(v).training, Some(crate::ir::Training::Frozen { .. })) && dims(g, v).is_some_and(|d| d.len() == 2))
                })
            })
        {
            self.positions = Positions::Rope;
        }
    }

    /// The layer roles as the engines group them: the layers before the first block (the
    /// embedding), the blocks, the layers after the last (the head and loss). Fails naming a
    /// layer between blocks that is not one, or a model without blocks.
    pub fn check_structure(&self) -> Result<[usize; 2], String> {
        if let Some((l, name)) = &self.misplaced {
            return Err(format!("layer {l} (`{name}`) sits between transformer blocks but is not one"));
        }
        self.block_range.ok_or_else(|| "the model has no repeated transformer blocks".to_string())
    }

    /// Whether layer `l` is a transformer block.
    pub fn is_block(&self, l: usize) -> bool {
        self.kinds.get(l) == Some(&LayerKind::Block)
    }

    /// Transformer blocks among layers `range[0]..=range[1]`.
    pub fn blocks_in(&self, range: [usize; 2]) -> usize {
        (range[0]..=range[1]).filter(|&l| self.is_block(l)).count()
    }

    /// The index among the blocks of layer `l` (a block).
    pub fn block_index(&self, l: usize) -> usize {
        (0..l).filter(|&i| self.is_block(i)).count()
    }

    /// The layer index of block `b`.
    pub fn layer_of_block(&self, b: usize) -> Option<usize> {
        (0..self.kinds.len()).filter(|&l| self.is_block(l)).nth(b)
    }
}

/// Whether `v` is a graph input, or one reshaped, cast or unsqueezed (the token ids a
/// `view` flattens before the embedding's Gather).
fn from_input(g: &Graph, v: ValueId) -> bool {
    let mut v = v;
    for _ in 0..4 {
        if g.value(v).kind == ValueKind::Input {
            return true;
        }
        let Some(p) = g.value(v).producer else { return false };
        if !matches!(kind(g, p), Some(OpKind::Reshape | OpKind::Cast | OpKind::Unsqueeze | OpKind::Squeeze | OpKind::Flatten | OpKind::Identity)) {
            return false;
        }
        let Some(Some(x)) = g.node(p).inputs.first().copied() else { return false };
        v = x;
    }
    false
}

/// A symbolic batch or sequence dim is still a dim: its rank with placeholder sizes.
fn rank_only(g: &Graph, v: ValueId) -> Option<Vec<i64>> {
    let s = g.value(v).ty.as_ref()?.shape.as_ref()?;
    Some(s.0.iter().map(|d| d.known().unwrap_or(1)).collect())
}

fn rope_if_unknown(p: Positions) -> Positions {
    match p {
        Positions::Unknown => Positions::Rope,
        other => other,
    }
}
