//! What every kernel shares: its error, the context a node runs in (training, dropout key,
//! normalisation statistics), its inputs and attributes (`Args`), and axis normalisation.

use tch::{Kind, Tensor};

use crate::ir::{Attrs, Node};

/// A kernel's failure message (the executor adds node and op).
#[derive(Debug)]
pub struct KernelError(pub String);

impl From<tch::TchError> for KernelError {
    fn from(e: tch::TchError) -> Self {
        KernelError(e.to_string())
    }
}

impl From<String> for KernelError {
    fn from(e: String) -> Self {
        KernelError(e)
    }
}

pub(crate) type KResult<T> = Result<T, KernelError>;

macro_rules! bail {
    ($($t:tt)*) => { return Err($crate::runtime::kernels::ops::KernelError(format!($($t)*))) };
}
pub(crate) use bail;

/// How kernels run: the dtype policy and the step's context. (Every node is in the canonical
/// form the importer writes, so no kernel reads the model's opset.)
#[derive(Clone, Copy, Debug)]
pub struct OpContext {
    /// When set, every floating-point tensor a kernel creates (casts, constants) uses this kind
    /// (the `--dtype` of a run), so a model exported in f32 runs in f64 or bf16.
    pub float_kind: Option<Kind>,
    /// Training run: Dropout with `training_mode` still follows the model (never on by itself).
    pub training: bool,
    /// Which statistics BatchNormalization normalises with.
    pub norm: NormStats,
    /// In a training step, what a Dropout mask is drawn from (none: the global generator).
    pub dropout: Option<DropoutKey>,
    /// Mixed precision: the low kind `torch.autocast` computes matrix products in (the
    /// kernels' inputs are cast by [`super::run`], by the op's [`super::AutocastClass`]).
    pub autocast: Option<Kind>,
    /// Under context parallelism, this rank's place in its group (Dropout on local tokens
    /// draws the one-process mask and keeps the rank's rows).
    pub context: Option<crate::runtime::kernels::context::ContextRank>,
}

/// The key of a training step's Dropout masks. A mask is a function of the run's seed, the
/// step, the node and the sample's index in the global batch alone, so a recomputed forward
/// draws the masks of the first, a resumed run those of the uninterrupted one, and every plan
/// those of one process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutKey {
    /// The run's seed.
    pub seed: i64,
    /// The optimizer step (the global batch's index).
    pub step: i64,
    /// Index in the global batch of the microbatch's first sample.
    pub first_sample: i64,
}

/// The statistics BatchNormalization uses, whatever mode the model was exported in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NormStats {
    /// The running statistics (inference, validation), unless the node asks for batch
    /// statistics itself (`training_mode` 1).
    #[default]
    Running,
    /// The microbatch's statistics, as a module in `train()` mode computes them. With `update`
    /// the running statistics move towards them by PyTorch's momentum rule (unbiased variance);
    /// a recomputed forward passes `update: false`, so each microbatch updates them once.
    Batch { update: bool },
}

/// The inputs and attributes of one node, with typed getters.
pub(crate) struct Args<'a> {
    pub node: &'a Node,
    pub inputs: &'a [Option<Tensor>],
    pub ctx: &'a OpContext,
}

impl<'a> Args<'a> {
    pub fn attrs(&self) -> &Attrs {
        &self.node.attrs
    }

    /// Required input `i`.
    pub fn x(&self, i: usize) -> KResult<&'a Tensor> {
        match self.inputs.get(i) {
            Some(Some(t)) => Ok(t),
            _ => Err(KernelError(format!("input {i} is required but missing"))),
        }
    }

    /// Optional input `i`.
    pub fn opt(&self, i: usize) -> Option<&'a Tensor> {
        self.inputs.get(i).and_then(|t| t.as_ref())
    }

    /// Optional input `i` read as integers (shape arithmetic).
    pub fn ints(&self, i: usize) -> KResult<Option<Vec<i64>>> {
        match self.opt(i) {
            Some(t) => Ok(Some(crate::runtime::kernels::tensor::to_i64_vec(t)?)),
            None => Ok(None),
        }
    }

    /// Optional scalar input `i` as f64.
    pub fn scalar(&self, i: usize) -> KResult<Option<f64>> {
        match self.opt(i) {
            Some(t) => {
                let v = crate::runtime::kernels::tensor::to_f64_vec(t)?;
                match v.as_slice() {
                    [x] => Ok(Some(*x)),
                    _ => bail!("input {i} must hold one value, it has {}", v.len()),
                }
            }
            None => Ok(None),
        }
    }

    pub fn int(&self, name: &str, default: i64) -> i64 {
        self.node.attrs.int(name, default)
    }

    /// A `FLOAT` attribute as the decimal the exporter wrote (see `Attrs::real`).
    pub fn float(&self, name: &str, default: f64) -> f64 {
        self.node.attrs.real(name, default)
    }

    pub fn n_out(&self) -> usize {
        self.node.outputs.len()
    }

    /// The kind a float tensor made by this op should have.
    pub fn float_kind(&self, default: Kind) -> Kind {
        self.ctx.float_kind.unwrap_or(default)
    }
}

/// Normalises a possibly negative axis against `rank`.
pub(crate) fn axis(a: i64, rank: usize) -> KResult<i64> {
    let r = rank as i64;
    let v = if a < 0 { a + r } else { a };
    if v < 0 || v >= r.max(1) {
        bail!("axis {a} is out of range for rank {rank}");
    }
    Ok(v)
}

/// Normalises several axes; duplicates are an error.
pub(crate) fn axes(list: &[i64], rank: usize) -> KResult<Vec<i64>> {
    let mut out = Vec::with_capacity(list.len());
    for &a in list {
        let v = axis(a, rank)?;
        if out.contains(&v) {
            bail!("axis {a} is repeated in {list:?}");
        }
        out.push(v);
    }
    Ok(out)
}

