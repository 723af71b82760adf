//! Lowering and simulation speed on large pipelines (prints numbers; no assertions).
//! `cargo bench --bench sim`

use std::time::Instant;

use smp_partition::codegen::{LowerOptions, lower_schedule};
use smp_partition::ir::ScheduleKind;
use smp_partition::sim::{CostTable, simulate};

fn main() {
    let cases = [
        (ScheduleKind::OneFOneB, 8, 96),
        (ScheduleKind::OneFOneB, 64, 512),
        (ScheduleKind::Interleaved { virtual_stages: 4 }, 32, 256),
        (ScheduleKind::ZbH1, 64, 512),
        (ScheduleKind::GPipe, 16, 128),
    ];
    for (kind, p, m) in cases {
        let t0 = Instant::now();
        let progs = lower_schedule(kind, p, m, &LowerOptions::default()).expect("valid schedule");
        let lowered = t0.elapsed();
        let instrs: usize = progs.iter().map(|r| r.instrs.len()).sum();
        let t1 = Instant::now();
        let r = simulate(&progs, &CostTable::uniform(kind.stages(p), 1.0, 1.0, 1.0)).expect("deadlock-free");
        let simulated = t1.elapsed();
        println!(
            "{kind:>14} p={p:<3} m={m:<4} instrs={instrs:<7} lower {:>8.2} ms  simulate {:>8.2} ms  ({:.2} µs/instr)  bubble {:.4}",
            lowered.as_secs_f64() * 1e3,
            simulated.as_secs_f64() * 1e3,
            simulated.as_secs_f64() * 1e6 / instrs as f64,
            r.bubble_ratio
        );
    }
}
