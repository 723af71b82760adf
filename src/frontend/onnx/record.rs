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
    let padding_rows: Vec<i64> = match get("smp.padding_rows") {
        None => Vec::new(),
        Some(s) => serde_json::from_str(s).map_err(|e| bad(format!("`smp.padding_rows` is not a JSON list of row numbers: {e}")))?,
    };
    if !padding_rows.is_empty() {
        if kind != RecordKind::Parameter || params.len() != 1 {
            return Err(bad("`smp.padding_rows` belongs on a parameter record of one module tensor".into()));
        }
        // the module tensor's row count, where the initializer shows it
        let rows = match transform {
            ParamTransform::Identity => t.dims.first().copied(),
            ParamTransform::Transpose => t.dims.get(1).copied(),
            ParamTransform::Gather { .. } => None,
        };
        if let Some(&r) = padding_rows.iter().find(|&&r| r < 0) {
            return Err(bad(format!("`smp.padding_rows` names row {r}: rows are counted from 0")));
        }
        if let (Some(n), Some(&r)) = (rows, padding_rows.iter().max()) && r >= n {
            return Err(bad(format!("`smp.padding_rows` names row {r} of a tensor with {n} rows")));
        }
    }
    Ok(Some(ParamRecord { kind, params, transform, sites, persistent, trainable, padding_rows }))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::onnx::proto::StringStringEntryProto;

    fn table(props: &[(&str, &str)]) -> TensorProto {
        let metadata_props = props.iter().map(|(k, v)| StringStringEntryProto { key: Some(k.to_string()), value: Some(v.to_string()) }).collect();
        TensorProto { name: Some("emb.weight".into()), dims: vec![12, 8], metadata_props, ..Default::default() }
    }

    fn padding(extra: &[(&str, &str)]) -> Result<Vec<i64>, String> {
        let mut props = vec![("smp.kind", "parameter"), ("smp.params", r#"[["emb.weight"]]"#)];
        props.extend_from_slice(extra);
        match read(&table(&props), Path::new("m.onnx")) {
            Ok(rec) => Ok(rec.map(|r| r.padding_rows).unwrap_or_default()),
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn padding_rows_are_read_and_checked_against_the_table() {
        assert_eq!(padding(&[]), Ok(vec![]));
        assert_eq!(padding(&[("smp.padding_rows", "[7]")]), Ok(vec![7]));
        let err = padding(&[("smp.padding_rows", "[12]")]).unwrap_err();
        assert!(err.contains("emb.weight") && err.contains("row 12 of a tensor with 12 rows"), "{err}");
        let err = padding(&[("smp.padding_rows", "[-1]")]).unwrap_err();
        assert!(err.contains("rows are counted from 0"), "{err}");
        let err = padding(&[("smp.padding_rows", "7")]).unwrap_err();
        assert!(err.contains("not a JSON list of row numbers"), "{err}");
        let merged = [("smp.params", r#"[["a.weight"], ["b.weight"]]"#), ("smp.padding_rows", "[1]")];
        let err = read(&table(&[("smp.kind", "parameter"), merged[0], merged[1]]), Path::new("m.onnx")).unwrap_err().to_string();
        assert!(err.contains("one module tensor"), "{err}");
    }
}
