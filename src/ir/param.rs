//! What an initializer stands for (the exporter's parameter record, docs/parameter-record.md)
//! and what is trained (the decision of `passes::params`).

/// How an initializer's values derive from the module tensor it stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParamTransform {
    /// The tensor itself.
    Identity,
    /// The 2-D tensor transposed (a Linear weight stored for `MatMul`).
    Transpose,
    /// Rows of the tensor gathered along axis 0 at export time (positions of a fixed-shape
    /// export): the initializer is `param[rows]`, `rows` shaped `dims`.
    Gather {
        /// Shape of the row-index array.
        dims: Vec<i64>,
        /// Row indices, row-major.
        rows: Vec<i64>,
    },
}

/// What the exporter said an initializer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// Module parameters: trained.
    Parameter,
    /// A module buffer: never trained.
    Buffer,
    /// A folded constant (mask, RoPE cache, shape): never trained.
    Constant,
}

/// The record the export wrote on one initializer (`TensorProto.metadata_props`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamRecord {
    /// Parameter, buffer or constant.
    pub kind: RecordKind,
    /// The module tensors it stands for, one entry each (several: the exporter merged equal
    /// values); an entry lists the aliases of one tied tensor.
    pub params: Vec<Vec<String>>,
    /// How its values derive from them.
    pub transform: ParamTransform,
    /// For merged initializers: the nodes (by name) that use each entry of `params`.
    pub sites: Vec<Vec<String>>,
    /// False for a buffer the module's `state_dict` leaves out (`smp.persistent: false`,
    /// RoPE's `inv_freq`): the trained weights written out never hold it.
    pub persistent: bool,
    /// False for a parameter the module holds with `requires_grad = False`
    /// (`smp.trainable: false`): it is loaded and written out, never trained.
    pub trainable: bool,
    /// Rows (axis 0) of the module tensor whose lookups send it no gradient
    /// (`smp.padding_rows`: `nn.Embedding`'s `padding_idx`); empty for most tensors.
    pub padding_rows: Vec<i64>,
}

impl ParamRecord {
    /// The canonical name of entry `i` (its first alias).
    pub fn name(&self, i: usize) -> Option<&str> {
        self.params.get(i).and_then(|a| a.first()).map(String::as_str)
    }
}

/// Why an initializer is held frozen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrozenReason {
    /// The record says it is a module buffer.
    Buffer,
    /// The record says it is a folded constant.
    Constant,
    /// Not floating point, or a scalar (exporters store constants such as `sqrt(d)` so).
    NotAWeight,
    /// Without a record: it only reaches masks, positions or shapes, or holds mask values.
    MaskOrPosition,
    /// Without a record: the name of a well-known buffer (RoPE tables, masks, position ids).
    BufferName,
    /// A `--frozen` pattern.
    Pattern,
    /// The module holds the parameter frozen (`requires_grad = False`, the record's
    /// `smp.trainable: false`).
    Module,
}

/// How the trained-or-frozen decision was reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecisionSource {
    /// The export's parameter record.
    Record,
    /// Structural rules (no record).
    Structure,
    /// A `--trainable` / `--frozen` pattern.
    Pattern,
}

/// The decision for one initializer: trained (as which module tensor) or frozen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Training {
    /// Trained; every use of the initializer shares one gradient (a real tie when it has
    /// several uses).
    Trained {
        /// The module tensor's names (aliases); the initializer's own name without a record.
        names: Vec<String>,
        /// How the values derive from it (gathers are rewritten to nodes, so this is
        /// `Identity` or `Transpose`).
        transform: ParamTransform,
        /// The initializer it was untied from and the number of copies made, if untied.
        untied_from: Option<(String, usize)>,
        /// Where the decision came from.
        source: DecisionSource,
    },
    /// Never trained.
    Frozen {
        /// Why.
        reason: FrozenReason,
    },
}

impl Training {
    /// True for [`Training::Trained`].
    pub fn is_trained(&self) -> bool {
        matches!(self, Training::Trained { .. })
    }
}
