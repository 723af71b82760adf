//! What is minimised: the loss kinds, each microbatch's loss summed over its counted targets,
//! and the counts that make a step's loss the mean over its global batch.

use tch::{Kind, Reduction, Tensor};

use crate::ir::ValueKind;
use crate::runtime::RuntimeError;
use crate::runtime::data::{Batch, DataSource};
use crate::runtime::kernels::context::{self, ContextRank};
use crate::runtime::kernels::executor::Executor;
use crate::runtime::kernels::tensor::is_float_kind;

/// Which scalar is minimised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossKind {
    /// The model's own scalar output.
    Model,
    /// Cross-entropy of `logits[:, :-1]` against `input_ids[:, 1:]`.
    CausalLm,
    /// Cross-entropy of the logits against a `labels` array (ignore index −100).
    CrossEntropy,
    /// Mean squared error of the first output against a `targets` (or `labels`) array.
    Mse,
    /// A sequence-to-sequence model's loss: cross-entropy of the decoder's logits against a
    /// `labels` array (ignore index −100), as the model computes it from `labels`; the data's
    /// `decoder_input_ids` must be those labels shifted right by one (the model's
    /// `prepare_decoder_input_ids_from_labels`), which is checked.
    Seq2Seq,
}

impl LossKind {
    /// The loss a run minimises when none is asked: the model's own scalar output if it has
    /// one (an auxiliary loss, such as a router's, is not one), else a sequence-to-sequence
    /// loss for a model with decoder inputs, else causal language modelling.
    pub fn infer(graph: &crate::ir::Graph) -> LossKind {
        let scalar_out = graph
            .outputs
            .iter()
            .filter(|&&v| !graph.aux_losses.iter().any(|a| a.output == v))
            .any(|&v| graph.value(v).ty.as_ref().and_then(|t| t.shape.as_ref()).is_some_and(|s| s.numel() == Some(1)));
        let seq2seq = graph.inputs.iter().any(|&v| graph.value(v).name == DECODER_INPUT_IDS);
        if scalar_out {
            LossKind::Model
        } else if seq2seq {
            LossKind::Seq2Seq
        } else {
            LossKind::CausalLm
        }
    }

    /// Whether the loss is a sum over tokens (what context parallelism splits).
    pub fn per_token(self) -> bool {
        matches!(self, LossKind::CausalLm | LossKind::CrossEntropy)
    }

    /// Parses a `--loss` value.
    pub fn parse(s: &str) -> Option<LossKind> {
        Some(match s {
            "model" => LossKind::Model,
            "causal-lm" => LossKind::CausalLm,
            "cross-entropy" => LossKind::CrossEntropy,
            "mse" => LossKind::Mse,
            "seq2seq" => LossKind::Seq2Seq,
            _ => return None,
        })
    }
}


/// The loss of one microbatch from the model's outputs: the mean over its counted targets.
pub fn loss_of(exec: &Executor, kind: LossKind, mb: &Batch, outs: &[Tensor]) -> Result<Tensor, RuntimeError> {
    Ok(loss_sum_of(exec, kind, mb, outs)?.f_div_scalar(target_count(exec, kind, mb)?)?)
}

/// The loss of one microbatch summed over its counted targets (tokens whose label is not
/// -100, squared errors, or the model's own mean loss times its rows), plus the model's
/// auxiliary losses (`Graph::aux_losses`: each its coefficient times its value times the counted
/// targets). A step's loss is the sum over its microbatches and replicas divided by
/// [`global_target_count`], so it is the mean over the whole global batch whatever the
/// microbatch count (as PyTorch computes it on the whole batch, and as Hugging Face's
/// `num_items_in_batch` does under gradient accumulation).
pub fn loss_sum_of(exec: &Executor, kind: LossKind, mb: &Batch, outs: &[Tensor]) -> Result<Tensor, RuntimeError> {
    // autocast computes losses in fp32 (cross_entropy and mse_loss are on its fp32 list)
    let widened: Vec<Tensor>;
    let outs = if exec.autocast().is_some() {
        widened = outs.iter().map(|t| if matches!(t.kind(), Kind::Half | Kind::BFloat16) { t.f_to_kind(Kind::Float) } else { Ok(t.shallow_clone()) }).collect::<Result<_, _>>()?;
        &widened
    } else {
        outs
    };
    let main = main_loss_sum(exec, kind, mb, outs)?;
    let graph = exec.graph();
    if graph.aux_losses.is_empty() {
        return Ok(main);
    }
    // each auxiliary loss is a mean over the microbatch (as the model computes it per forward):
    // weighted by the microbatch's counted targets, the step's loss is the model's own
    // `loss + coefficient · aux` averaged over microbatches and replicas as the main loss is
    let targets = target_count(exec, kind, mb)?;
    let mut total = main;
    for aux in &graph.aux_losses {
        let at = graph.outputs.iter().position(|&o| o == aux.output);
        let t = at.and_then(|i| outs.get(i)).ok_or_else(|| train_err(&format!("the auxiliary loss `{}` was not computed", graph.value(aux.output).name)))?;
        total = total.f_add(&t.f_reshape([0i64; 0])?.f_to_kind(total.kind())?.f_mul_scalar(aux.coefficient * targets)?)?;
    }
    Ok(total)
}

/// [`loss_sum_of`] without the model's auxiliary losses.
fn main_loss_sum(exec: &Executor, kind: LossKind, mb: &Batch, outs: &[Tensor]) -> Result<Tensor, RuntimeError> {
    let first_float = outs.iter().find(|t| is_float_kind(t.kind())).ok_or_else(|| train_err("the model has no float output"))?;
    Ok(match kind {
        LossKind::Model => {
            let graph = exec.graph();
            let aux = |i: usize| graph.outputs.get(i).is_some_and(|o| graph.aux_losses.iter().any(|a| a.output == *o));
            let t = outs
                .iter()
                .enumerate()
                .filter(|&(i, _)| !aux(i))
                .map(|(_, t)| t)
                .find(|t| t.numel() == 1 && is_float_kind(t.kind()))
                .ok_or_else(|| train_err("the model has no scalar output; pass --loss causal-lm|cross-entropy|mse"))?;
            // the model's loss is a mean over its rows
            t.f_reshape([0i64; 0])?.f_mul_scalar(batch_rows(mb)?)?
        }
        LossKind::CausalLm => {
            let logits = outs
                .iter()
                .find(|t| t.dim() == 3 && is_float_kind(t.kind()))
                .ok_or_else(|| train_err("causal-lm needs a [batch, seq, vocab] logits output"))?;
            let v = logits.size3()?.2;
            // every position predicts its next token and the sequence's last predicts none (an
            // ignored target), so the logits are read whole: no shifted copy of them, forward
            // or backward (HF's `logits[:, :-1].contiguous()`)
            let target = causal_targets(exec, mb, exec.context_rank())?;
            let pred = match exec.context_rank() {
                Some(me) => local_tokens(logits, me, &target)?,
                None => logits.shallow_clone(),
            };
            pred.f_reshape([-1, v])?.f_cross_entropy_loss(&target, None::<&Tensor>, Reduction::Sum, IGNORE_INDEX, 0.0)?
        }
        LossKind::CrossEntropy | LossKind::Seq2Seq => {
            if kind == LossKind::Seq2Seq {
                check_decoder_inputs(mb)?;
            }
            let v = *first_float.size().last().unwrap_or(&1);
            let me = exec.context_rank();
            let labels = class_labels(mb, me)?;
            let pred = match me {
                Some(me) => local_tokens(first_float, me, &labels)?,
                None => first_float.shallow_clone(),
            };
            let pred = pred.f_reshape([-1, v])?;
            pred.f_cross_entropy_loss(&labels, None::<&Tensor>, Reduction::Sum, IGNORE_INDEX, 0.0)?
        }
        LossKind::Mse => {
            let target = regression_targets(mb)?;
            first_float.f_mse_loss(&target.f_to_kind(first_float.kind())?, Reduction::Sum)?
        }
    })
}

/// Label value that no loss counts (PyTorch's `ignore_index` default).
pub const IGNORE_INDEX: i64 = -100;

/// How many targets of `mb` the loss counts: labels other than [`IGNORE_INDEX`], regression
/// target elements, or the rows of a model that computes its own (mean) loss.
pub fn target_count(exec: &Executor, kind: LossKind, mb: &Batch) -> Result<f64, RuntimeError> {
    count_targets(exec, kind, mb, exec.context_rank())
}

/// [`target_count`] of the tokens rank `me` of a context group holds (all, if none).
fn count_targets(exec: &Executor, kind: LossKind, mb: &Batch, me: Option<ContextRank>) -> Result<f64, RuntimeError> {
    let counted = |t: &Tensor| -> Result<f64, RuntimeError> { Ok(t.f_ne(IGNORE_INDEX)?.f_sum(Kind::Int64)?.f_int64_value(&[])? as f64) };
    match kind {
        LossKind::Model => batch_rows(mb),
        LossKind::CausalLm => counted(&causal_targets(exec, mb, me)?),
        LossKind::CrossEntropy | LossKind::Seq2Seq => counted(&class_labels(mb, me)?),
        LossKind::Mse => Ok(regression_targets(mb)?.numel() as f64),
    }
}

/// Rank `me`'s tokens (axis 1) of a `[batch, seq, ..]` output, lined up with its flattened
/// `targets`: the output itself when it holds as many tokens (the split left it local), else
/// cut from the whole sequence.
fn local_tokens(t: &Tensor, me: ContextRank, targets: &Tensor) -> Result<Tensor, RuntimeError> {
    let size = t.size();
    if size.len() < 2 {
        return Err(train_err("a per-token loss needs [batch, seq, ..] outputs"));
    }
    if size[0] * size[1] == targets.numel() as i64 {
        return Ok(t.shallow_clone());
    }
    context::localize(t, 1, context::Blocks { outer: 1, seq: 0 }, me).map_err(|e| train_err(&e))
}

/// The targets counted in global batch `k` of `data`, over every replica and microbatch.
pub fn global_target_count(exec: &Executor, kind: LossKind, data: &DataSource, k: usize) -> Result<f64, RuntimeError> {
    let whole = data.replica_microbatches(k, 0, 1, 1)?;
    let n = whole.iter().map(|mb| count_targets(exec, kind, mb, None)).sum::<Result<f64, _>>()?;
    if n <= 0.0 {
        return Err(train_err(&format!("batch {k} of the data has no counted target (every label is {IGNORE_INDEX}); its loss is undefined")));
    }
    Ok(n)
}

fn train_err(m: &str) -> RuntimeError {
    RuntimeError::Train(m.to_string())
}

/// Samples in a batch: the first dim of its arrays.
fn batch_rows(mb: &Batch) -> Result<f64, RuntimeError> {
    let (_, t) = mb.first().ok_or_else(|| train_err("a model that computes its own loss needs --data with its inputs"))?;
    Ok(t.size().first().copied().unwrap_or(1) as f64)
}

fn find_array<'b>(mb: &'b Batch, keys: &[&str]) -> Option<&'b Tensor> {
    mb.iter().find(|(n, _)| keys.contains(&n.as_str())).map(|(_, t)| t)
}

/// The next-token targets of a causal LM, one per position, flattened: the token ids shifted
/// by one, each sequence's last position targeting nothing ([`IGNORE_INDEX`]); under context
/// parallelism (`me`), those of the rank's positions.
fn causal_targets(exec: &Executor, mb: &Batch, me: Option<ContextRank>) -> Result<Tensor, RuntimeError> {
    let graph = exec.graph();
    let ids = exec
        .required_inputs()
        .into_iter()
        .filter(|&id| {
            let v = graph.value(id);
            v.kind == ValueKind::Input && v.ty.as_ref().is_some_and(|t| t.dtype.is_int())
        })
        .max_by_key(|&id| graph.value(id).name.contains("input_ids"))
        .ok_or_else(|| train_err("causal-lm needs an integer token-id input"))?;
    let name = &graph.value(ids).name;
    let ids = crate::runtime::kernels::executor::batch_array(mb, name)?;
    let s = ids.size().get(1).copied().ok_or_else(|| train_err("causal-lm needs [batch, seq] token ids"))?;
    let next = ids.f_narrow(1, 1, s - 1)?.f_to_kind(Kind::Int64)?;
    let none = Tensor::f_full([next.size()[0], 1], IGNORE_INDEX, (Kind::Int64, next.device()))?;
    let shifted = Tensor::f_cat(&[next, none], 1)?;
    let Some(me) = me else { return Ok(shifted.f_reshape([-1])?) };
    Ok(context::localize(&shifted, 1, context::Blocks { outer: 1, seq: 0 }, me).map_err(|e| train_err(&e))?.f_reshape([-1])?)
}

/// The labels, flattened; under context parallelism (`me`), the rank's tokens of per-token
/// `[batch, seq]` labels.
fn class_labels(mb: &Batch, me: Option<ContextRank>) -> Result<Tensor, RuntimeError> {
    let labels = find_array(mb, &["labels", "label", "targets"]).ok_or_else(|| train_err("cross-entropy needs a `labels` array in --data"))?;
    let labels = match me {
        Some(me) if labels.dim() == 2 => context::localize(labels, 1, context::Blocks { outer: 1, seq: 0 }, me).map_err(|e| train_err(&e))?,
        Some(_) => return Err(train_err(&format!("context parallelism splits tokens, but the labels are {:?}, not [batch, seq]; re-plan with --cp 1", labels.size()))),
        None => labels.shallow_clone(),
    };
    Ok(labels.f_reshape([-1])?.f_to_kind(Kind::Int64)?)
}

impl std::str::FromStr for LossKind {
    type Err = String;
    /// `--loss`: model, causal-lm, cross-entropy, mse or seq2seq.
    fn from_str(s: &str) -> Result<Self, String> {
        LossKind::parse(s).ok_or_else(|| format!("`{s}`: expected model, causal-lm, cross-entropy, mse or seq2seq"))
    }
}

/// Graph input of a sequence-to-sequence model's decoder tokens (Hugging Face's name).
pub const DECODER_INPUT_IDS: &str = "decoder_input_ids";

/// Refuses a batch whose `decoder_input_ids` (where it holds them) are not its `labels`
/// shifted right by one: the decoder would be taught to predict other tokens than it reads.
fn check_decoder_inputs(mb: &Batch) -> Result<(), RuntimeError> {
    let (Some(dec), Some(labels)) = (find_array(mb, &[DECODER_INPUT_IDS]), find_array(mb, &["labels"])) else {
        return Ok(());
    };
    let (d, l) = (dec.size(), labels.size());
    if d.len() != 2 || d != l {
        return Err(train_err(&format!("seq2seq: `{DECODER_INPUT_IDS}` is {d:?} and `labels` {l:?}; both must be [batch, target length]")));
    }
    let s = l[1];
    let prev = labels.f_narrow(1, 0, s - 1)?.f_to_kind(Kind::Int64)?;
    let next = dec.f_narrow(1, 1, s - 1)?.f_to_kind(Kind::Int64)?;
    let counted = prev.f_ne(IGNORE_INDEX)?;
    let wrong = next.f_ne_tensor(&prev)?.f_logical_and(&counted)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    if wrong > 0 {
        return Err(train_err(&format!(
            "seq2seq: `{DECODER_INPUT_IDS}` are not `labels` shifted right by one ({wrong} tokens differ); make them with the model's \
             `prepare_decoder_input_ids_from_labels(labels=labels)`"
        )));
    }
    Ok(())
}

fn regression_targets(mb: &Batch) -> Result<&Tensor, RuntimeError> {
    find_array(mb, &["targets", "target", "labels"]).ok_or_else(|| train_err("mse needs a `targets` array in --data"))
}

