//! Human-readable IR dump (`Display` for `Graph`), stable enough for snapshots.

use std::fmt;

use super::{Graph, ValueId, ValueKind};

impl Graph {
    fn fmt_value(&self, f: &mut fmt::Formatter<'_>, v: ValueId) -> fmt::Result {
        let val = self.value(v);
        match &val.ty {
            Some(t) => write!(f, "%{}: {}", val.name, t),
            None => write!(f, "%{}: ?", val.name),
        }
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "graph {:?}", self.name)?;
        for (domain, v) in &self.opsets {
            let d = if domain.is_empty() { "ai.onnx" } else { domain };
            write!(f, " {d}={v}")?;
        }
        writeln!(f)?;
        for &v in &self.inputs {
            f.write_str("  input ")?;
            self.fmt_value(f, v)?;
            writeln!(f)?;
        }
        for v in self.value_ids() {
            let val = self.value(v);
            if val.kind == ValueKind::Initializer {
                f.write_str("  init  ")?;
                self.fmt_value(f, v)?;
                writeln!(f)?;
            }
        }
        let order = self.topo_order().map_err(|_| fmt::Error)?;
        for id in order {
            let node = self.node(id);
            f.write_str("  ")?;
            for (i, &o) in node.outputs.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                self.fmt_value(f, o)?;
            }
            write!(f, " = {}", node.op)?;
            if !node.attrs.0.is_empty() {
                f.write_str("[")?;
                for (i, (k, a)) in node.attrs.0.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{k}={a}")?;
                }
                f.write_str("]")?;
            }
            f.write_str("(")?;
            for (i, inp) in node.inputs.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                match inp {
                    Some(v) => {
                        let val = self.value(*v);
                        if val.kind == ValueKind::Constant {
                            if let Some(vals) = val.data.as_ref().and_then(|d| d.to_i64_vec()).filter(|x| x.len() <= 8) {
                                write!(f, "const{vals:?}")?;
                                continue;
                            }
                        }
                        write!(f, "%{}", val.name)?;
                    }
                    None => f.write_str("_")?,
                }
            }
            f.write_str(")")?;
            if let Some(ns) = &node.namespace {
                write!(f, "  @{ns}")?;
            }
            writeln!(f)?;
        }
        f.write_str("  return ")?;
        for (i, &v) in self.outputs.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "%{}", self.value(v).name)?;
        }
        writeln!(f)
    }
}
