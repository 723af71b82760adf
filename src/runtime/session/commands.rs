//! The runner's jobs beside training: a forward pass of a model on given inputs (`eval`) and
//! the trained model out of a checkpoint (`export`).

use std::path::{Path, PathBuf};

use super::options::{FloatType, InitChoice};
use super::{SessionError, decided, fuse_chains};
use crate::frontend::onnx::load_model;
use crate::runtime::kernels::executor::{self, ExecOptions, Executor};
use crate::runtime::state::checkpoint::{self, Loaded};
use crate::runtime::formats::npz;
use crate::runtime::state::export;
use crate::runtime::{InitMode, Weights};

/// What `eval` runs: a model, its inputs and where its outputs go.
#[derive(Clone, Debug)]
pub struct EvalJob {
    /// The ONNX model.
    pub model: PathBuf,
    /// Inputs, keyed by graph input name (`.npz`).
    pub inputs: PathBuf,
    /// Outputs, keyed by graph output name (`.npz`).
    pub outputs: PathBuf,
    /// Floating-point tensors run in this type (none: the model's own types).
    pub dtype: Option<FloatType>,
    /// How weights are materialised.
    pub init: InitChoice,
    /// Seed of random weights.
    pub seed: i64,
    /// Run with the trained weights of this checkpoint.
    pub checkpoint: Option<PathBuf>,
    /// Where the pass runs (`--device`; the outputs are written from the host).
    pub device: crate::runtime::device::DeviceRequest,
}

/// One forward pass of `job.model` on its inputs, outputs written as npz. The graph is the one
/// training runs (its op chains fused), so validation and evaluation agree to the last bit.
pub fn evaluate(job: &EvalJob) -> Result<(), SessionError> {
    let model = &job.model;
    // first: libtorch keeps its first answer about CUDA
    let local_rank = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let ranks = crate::runtime::device::Ranks { local_rank, local_world: local_rank + 1, world: 1 };
    let placement = job.device.place(ranks).map_err(|e| SessionError::Options(e.to_string()))?;
    let loaded = job.checkpoint.as_deref().map(Loaded::open).transpose()?;
    // a checkpoint's tensors are named as its run decided what is trained
    let params = loaded.as_ref().map(|l| l.manifest.state.params()).unwrap_or_default();
    let imported = load_model(model).map_err(|e| SessionError::Model(format!("cannot load model `{}`: {e}", model.display())))?;
    let (mut graph, sha256) = decided(imported.graph, imported.sha256, model, &params, None)?;
    fuse_chains(&mut graph);
    let float_kind = job.dtype.map(FloatType::kind);
    executor::check_supported(&graph).map_err(|e| SessionError::Model(format!("model `{}`: {e}", model.display())))?;
    let init = match job.init {
        InitChoice::Load => InitMode::Load,
        InitChoice::Random => InitMode::Random { seed: job.seed },
    };
    let mut weights = Weights::load(&graph, init, float_kind)?;
    if let Some(l) = &loaded {
        if l.manifest.state.model_sha256 != sha256 {
            return Err(SessionError::Options(format!("checkpoint `{}` was written for another model (sha256 {})", l.dir.display(), l.manifest.state.model_sha256)));
        }
        checkpoint::restore_params(l, &graph, &mut weights.tensors)?;
    }
    let exec = Executor::new_on(&graph, weights, ExecOptions { float_kind, training: false, autocast: None }, placement.device)?;
    let named = npz::read_npz(&job.inputs)?.into_iter().map(|(n, t)| Ok((n, t.f_to_device(placement.device)?))).collect::<Result<Vec<_>, crate::runtime::RuntimeError>>()?;
    let feeds = exec.bind_inputs(named).map_err(|e| SessionError::Options(format!("inputs file `{}`: {e}", job.inputs.display())))?;
    let outs = tch::no_grad(|| exec.forward(&feeds))?;
    let arrays: Vec<(String, tch::Tensor, Option<crate::ir::DType>)> = graph
        .outputs
        .iter()
        .zip(outs)
        .map(|(&v, t)| {
            let val = graph.value(v);
            (val.name.clone(), t, val.ty.as_ref().map(|ty| ty.dtype))
        })
        .collect();
    npz::write_npz(&job.outputs, &arrays)?;
    Ok(())
}

/// What `export` wrote.
#[derive(Clone, Debug)]
pub struct Exported {
    /// The file written.
    pub path: PathBuf,
    /// An ONNX export's external data file, if it has one.
    pub data: Option<PathBuf>,
    /// Tensors written (safetensors).
    pub tensors: usize,
    /// The checkpoint's step.
    pub step: usize,
}

/// Writes the trained model of checkpoint `ckpt` to `output`: `.onnx` (the model with its
/// trained weights; `external`: initializers in `OUT.onnx.data`, also when they exceed 1 GiB or
/// the model kept them outside) or `.safetensors` (the weights under module parameter names).
/// `model` defaults to the path the checkpoint's manifest records.
pub fn export_checkpoint(ckpt: &Path, output: &Path, model: Option<&Path>, external: bool) -> Result<Exported, SessionError> {
    let l = Loaded::open(ckpt)?;
    let model = model.map_or_else(|| PathBuf::from(&l.manifest.state.model_path), Path::to_path_buf);
    let imported = load_model(&model).map_err(|e| SessionError::Model(format!("cannot load model `{}`: {e}", model.display())))?;
    let (graph, sha256) = decided(imported.graph, imported.sha256, &model, &l.manifest.state.params(), None)?;
    if sha256 != l.manifest.state.model_sha256 {
        return Err(SessionError::Options(format!(
            "model `{}` is not the one checkpoint `{}` trained (sha256 differs); pass that model with --model",
            model.display(),
            l.dir.display()
        )));
    }
    let exec = export::trained_executor(&l, &graph).map_err(|e| SessionError::Options(format!("checkpoint `{}`: {e}", l.dir.display())))?;
    let step = l.manifest.state.step;
    match output.extension().and_then(|e| e.to_str()) {
        Some("safetensors") => {
            let keys = export::write_safetensors(&exec, output)?;
            Ok(Exported { path: output.to_path_buf(), data: None, tensors: keys.len(), step })
        }
        Some("onnx") => {
            let data = export::write_onnx(&exec, &model, output, export::needs_external_data(&graph, external))?;
            Ok(Exported { path: output.to_path_buf(), data, tensors: 0, step })
        }
        _ => Err(SessionError::Options(format!("export writes `.onnx` or `.safetensors`, not `{}`", output.display()))),
    }
}
