//! The parameter record on initializers (`smp.*` keys of `TensorProto.metadata_props`,
//! written by `smp_partition.param_record`; format in docs/parameter-record.md), and the
//! model-level `smp.aux_loss` list of auxiliary losses.

use std::path::Path;

use super::error::ImportError;
use super::proto::TensorProto;
use crate::ir::{ParamRecord, ParamTransform, RecordKind};

/// Reads the record of one initializer; `None` if it has none.
pub(crate) fn read(t: &TensorProto, file: &Path) -> Result<Option<ParamRecord>, ImportError> {
    let get = |key: &str| {
        t.metadata_props.iter().find(|p| p.key.as_deref() == Some(key)).and_then(|p| p.value.as_deref())
    };
    let Some(kind) = get("smp.kind") else { return Ok(None) };
    let name = t.name.clone().unwrap_or_default();
    let bad = |reason: String| ImportError::BadTensor {
        file: file.to_path_buf(),
        tensor: name.clone(),
        reason: format!("parameter record: {reason}; re-export with `smp_partition.export` or strip the `smp.*` metadata"),
    };
    let kind = match kind {
        "parameter" => RecordKind::Parameter,
        "buffer" => RecordKind::Buffer,
        "constant" => RecordKind::Constant,
        other => return Err(bad(format!("`smp.kind` is `{other}`, not parameter, buffer or constant"))),
    };
    let lists = |key: &str| -> Result<Vec<Vec<String>>, ImportError> {
        match get(key) {
            None => Ok(Vec::new()),
            Some(s) => serde_json::from_str(s).map_err(|e| bad(format!("`{key}` is not a JSON list of name lists: {e}"))),
        }
    };
    let params = lists("smp.params")?;
    let sites = lists("smp.sites")?;
    if kind == RecordKind::Parameter && params.iter().all(Vec::is_empty) {
        return Err(bad("a parameter without `smp.params`".into()));
    }
    if !sites.is_empty() && sites.len() != params.len() {
        return Err(bad(format!("`smp.sites` has {} entries, `smp.params` {}", sites.len(), params.len())));
    }
    let transform = match get("smp.transform").unwrap_or("identity") {
        "identity" => ParamTransform::Identity,
        "transpose" => ParamTransform::Transpose,
        "gather" => {
            #[derive(serde::Deserialize)]
            struct G {
                dims: Vec<i64>,
                rows: Vec<i64>,
            }
            let g: G = serde_json::from_str(get("smp.gather").ok_or_else(|| bad("`gather` without `smp.gather`".into()))?)
                .map_err(|e| bad(format!("`smp.gather` is not {{\"dims\": [...], \"rows\": [...]}}: {e}")))?;
            let n: i64 = g.dims.iter().product();
            if n != g.rows.len() as i64 || g.rows.iter().any(|&r| r < 0) {
                return Err(bad(format!("`smp.gather` has {} rows for dims {:?}", g.rows.len(), g.dims)));
            }
            ParamTransform::Gather { dims: g.dims, rows: g.rows }
        }
        other => return Err(bad(format!("`smp.transform` is `{other}`, not identity, transpose or gather"))),
    };
    let persistent = match get("smp.persistent").unwrap_or("true") {
        "true" => true,
        "false" => false,
        other => return Err(bad(format!("`smp.persistent` is `{other}`, not true or false"))),
    };
    let trainable = match get("smp.trainable").unwrap_or("true") {
        "true" => true,
        "false" => false,
        other => return Err(bad(format!("`smp.trainable` is `{other}`, not true or false"))),
    };
    Ok(Some(ParamRecord { kind, params, transform, sites, persistent, trainable }))
}

/// The model metadata key of the auxiliary losses (docs/parameter-record.md).
pub const AUX_LOSS_KEY: &str = "smp.aux_loss";

/// The auxiliary losses of `smp.aux_loss`: a JSON list of `{"output": NAME, "coefficient": C}`,
/// each a scalar float graph output.
pub(crate) fn aux_losses(g: &crate::ir::Graph, text: &str, file: &Path) -> Result<Vec<crate::ir::AuxLoss>, ImportError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Entry {
        output: String,
        coefficient: f64,
    }
    let bad = |reason: String| ImportError::BadAuxLoss { file: file.to_path_buf(), reason };
    let entries: Vec<Entry> = serde_json::from_str(text).map_err(|e| bad(format!("not a JSON list of {{\"output\", \"coefficient\"}}: {e}")))?;
    entries
        .into_iter()
        .map(|e| {
            let v = g.value_by_name(&e.output).filter(|v| g.outputs.contains(v));
            let Some(output) = v else { return Err(bad(format!("`{}` is not a graph output", e.output))) };
            let scalar = g.value(output).ty.as_ref().is_none_or(|t| t.dtype.is_float() && t.shape.as_ref().is_none_or(|s| s.0.is_empty()));
            if !scalar || !e.coefficient.is_finite() {
                return Err(bad(format!("`{}` must be a scalar float output with a finite coefficient (got {})", e.output, e.coefficient)));
            }
            Ok(crate::ir::AuxLoss { output, coefficient: e.coefficient })
        })
        .collect()
}
