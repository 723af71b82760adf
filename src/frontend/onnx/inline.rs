//! Inlining of model-local functions (`ModelProto.functions`).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::error::ImportError;
use super::proto::{AttributeProto, FunctionProto, NodeProto, StringStringEntryProto};

/// Calls nested deeper than this are refused (the spec forbids recursion; this bounds it).
const MAX_DEPTH: usize = 32;
/// Inlining that would make more nodes than this is refused (nested calls multiply).
const MAX_NODES: usize = 1_000_000;

/// `""` and `"ai.onnx"` both name the default domain.
pub(crate) fn normalize_domain(domain: &str) -> &str {
    if domain == "ai.onnx" { "" } else { domain }
}

type Key<'a> = (&'a str, &'a str, &'a str);

/// Model-local functions by (domain, name, overload).
pub(crate) struct Functions<'a> {
    by_key: HashMap<Key<'a>, &'a FunctionProto>,
    prefixes: HashSet<String>,
    calls: usize,
}

impl<'a> Functions<'a> {
    /// Indexes the model's functions.
    pub(crate) fn new(functions: &'a [FunctionProto]) -> Functions<'a> {
        let by_key = functions
            .iter()
            .map(|f| {
                let key = (
                    normalize_domain(f.domain.as_deref().unwrap_or("")),
                    f.name.as_deref().unwrap_or(""),
                    f.overload.as_deref().unwrap_or(""),
                );
                (key, f)
            })
            .collect();
        Functions { by_key, prefixes: HashSet::new(), calls: 0 }
    }

    /// Number of calls inlined so far.
    pub(crate) fn calls(&self) -> usize {
        self.calls
    }

    fn lookup(&self, node: &NodeProto) -> Option<&'a FunctionProto> {
        if self.by_key.is_empty() {
            return None;
        }
        let key = (
            normalize_domain(node.domain.as_deref().unwrap_or("")),
            node.op_type.as_deref().unwrap_or(""),
            node.overload.as_deref().unwrap_or(""),
        );
        self.by_key.get(&key).copied()
    }

    /// Appends `nodes` to `out`, replacing every function call by the function's body.
    pub(crate) fn expand(
        &mut self,
        nodes: Vec<NodeProto>,
        file: &Path,
        depth: usize,
        out: &mut Vec<NodeProto>,
    ) -> Result<(), ImportError> {
        if depth == 0 && !self.by_key.is_empty() {
            let mut memo = HashMap::new();
            if let Some(total) = self.expanded_size(&nodes, 0, &mut memo) {
                if total > MAX_NODES as u64 {
                    return Err(ImportError::BadNode {
                        file: file.to_path_buf(),
                        node: nodes
                            .iter()
                            .find(|n| self.lookup(n).is_some())
                            .and_then(|n| n.name.clone())
                            .unwrap_or_default(),
                        reason: format!(
                            "inlining the model-local functions would make {total} nodes, more than {MAX_NODES}"
                        ),
                    });
                }
            }
        }
        for node in nodes {
            let Some(function) = self.lookup(&node) else {
                out.push(node);
                continue;
            };
            let fname = function.name.as_deref().unwrap_or("");
            if depth >= MAX_DEPTH {
                return Err(ImportError::BadNode {
                    file: file.to_path_buf(),
                    node: node.name.clone().unwrap_or_default(),
                    reason: format!(
                        "calls of model-local function `{fname}` nest deeper than {MAX_DEPTH} (recursive function?)"
                    ),
                });
            }
            let body = self.instantiate(&node, function);
            self.calls += 1;
            self.expand(body, file, depth + 1, out)?;
        }
        Ok(())
    }

    /// Node count after inlining (saturating); `None` if calls nest too deep (recursion,
    /// which `expand` then reports).
    fn expanded_size(&self, nodes: &[NodeProto], depth: usize, memo: &mut HashMap<usize, u64>) -> Option<u64> {
        if depth > MAX_DEPTH {
            return None;
        }
        let mut total = 0u64;
        for node in nodes {
            let size = match self.lookup(node) {
                None => 1,
                Some(f) => {
                    let key = f as *const FunctionProto as usize;
                    match memo.get(&key) {
                        Some(&s) => s,
                        None => {
                            let s = self.expanded_size(&f.node, depth + 1, memo)?;
                            memo.insert(key, s);
                            s
                        }
                    }
                }
            };
            total = total.saturating_add(size);
        }
        Some(total)
    }

    /// The function's body for one call: values renamed, attribute references bound.
    fn instantiate(&mut self, call: &NodeProto, function: &FunctionProto) -> Vec<NodeProto> {
        let fname = function.name.as_deref().unwrap_or("function");
        let base = match call.name.as_deref() {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => fname.to_string(),
        };
        let mut prefix = format!("{base}/");
        let mut k = 1;
        while !self.prefixes.insert(prefix.clone()) {
            prefix = format!("{base}_{k}/");
            k += 1;
        }

        let mut rename: HashMap<&str, String> = HashMap::new();
        for (i, formal) in function.input.iter().enumerate() {
            rename.insert(formal, call.input.get(i).cloned().unwrap_or_default());
        }
        for (i, formal) in function.output.iter().enumerate() {
            match call.output.get(i) {
                Some(actual) if !actual.is_empty() => rename.insert(formal, actual.clone()),
                _ => rename.insert(formal, format!("{prefix}{formal}")),
            };
        }
        let map = |name: &String| -> String {
            if name.is_empty() {
                return String::new();
            }
            match rename.get(name.as_str()) {
                Some(r) => r.clone(),
                None => format!("{prefix}{name}"),
            }
        };

        let call_namespace = call.metadata_props.iter().find(|p| p.key.as_deref() == Some("namespace"));
        function
            .node
            .iter()
            .map(|inner| {
                let mut n = inner.clone();
                n.input = inner.input.iter().map(map).collect();
                n.output = inner.output.iter().map(map).collect();
                n.name = Some(match inner.name.as_deref() {
                    Some(name) if !name.is_empty() => format!("{prefix}{name}"),
                    _ => format!("{prefix}{}", inner.op_type.as_deref().unwrap_or("node")),
                });
                n.attribute = inner.attribute.iter().filter_map(|a| bind_attribute(a, call, function)).collect();
                if let Some(ns) = call_namespace {
                    if !n.metadata_props.iter().any(|p| p.key.as_deref() == Some("namespace")) {
                        n.metadata_props.push(StringStringEntryProto { key: ns.key.clone(), value: ns.value.clone() });
                    }
                }
                n
            })
            .collect()
    }
}

/// Resolves `ref_attr_name` against the call's attributes, then the function's defaults;
/// an unbound reference is dropped (the attribute is then absent, as the spec says).
fn bind_attribute(attr: &AttributeProto, call: &NodeProto, function: &FunctionProto) -> Option<AttributeProto> {
    let reference = match attr.ref_attr_name.as_deref() {
        Some(r) if !r.is_empty() => r,
        _ => return Some(attr.clone()),
    };
    let source = call
        .attribute
        .iter()
        .find(|a| a.name.as_deref() == Some(reference))
        .or_else(|| function.attribute_proto.iter().find(|a| a.name.as_deref() == Some(reference)))?;
    let mut bound = source.clone();
    bound.name = attr.name.clone();
    bound.ref_attr_name = None;
    Some(bound)
}
