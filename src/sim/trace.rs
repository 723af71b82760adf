//! Chrome/Perfetto trace export: one process per rank with a compute and a communication
//! track, complete events (`ph: "X"`) with `ts`/`dur` in microseconds, metadata events naming
//! the processes and tracks. Load the file in ui.perfetto.dev or chrome://tracing.

use serde_json::{Value, json};

use super::{EventKind, SimResult};

const COMPUTE_TID: u64 = 0;
const COMM_TID: u64 = 1;

/// The trace of a replay as a JSON object `{"traceEvents": [...], "displayTimeUnit": "ms"}`.
pub fn chrome_trace(result: &SimResult) -> Value {
    let mut events = Vec::with_capacity(result.events.len() + 3 * result.ranks.len());
    for (i, r) in result.ranks.iter().enumerate() {
        let pid = r.rank as u64;
        events.push(json!({"name": "process_name", "ph": "M", "pid": pid, "tid": COMPUTE_TID,
            "args": {"name": format!("rank {}", r.rank)}}));
        events.push(json!({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": COMPUTE_TID,
            "args": {"sort_index": i}}));
        events.push(json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": COMPUTE_TID,
            "args": {"name": "compute"}}));
        events.push(json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": COMM_TID,
            "args": {"name": "communication"}}));
    }
    for e in &result.events {
        let tid = match e.kind {
            EventKind::Transfer | EventKind::Collective => COMM_TID,
            _ => COMPUTE_TID,
        };
        let mut args = serde_json::Map::new();
        if let Some((stage, mb)) = e.stage_mb {
            args.insert("stage".into(), json!(stage));
            args.insert("microbatch".into(), json!(mb));
        }
        events.push(json!({
            "name": e.name,
            "cat": e.kind.name(),
            "ph": "X",
            "ts": e.start * 1e6,
            "dur": (e.end - e.start) * 1e6,
            "pid": e.rank as u64,
            "tid": tid,
            "args": args,
        }));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}
