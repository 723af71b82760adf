//! Work spread over the machine's cores, every result in its input's place, so that what the
//! planner (its candidates' layer problems and bounds) and code generation (the layers'
//! shards) produce is the same whatever the thread count.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Threads the planner uses: `SMP_PLANNER_THREADS` when set to a positive number, else the
/// machine's cores (at most 8: the parallel phases are short).
pub fn threads() -> usize {
    let set = std::env::var("SMP_PLANNER_THREADS").ok().and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0);
    set.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(8)))
}

/// `f` of every item, on up to `threads` threads (each taking the next unclaimed item), the
/// results in the items' order.
pub fn map<T: Sync, R: Send>(items: &[T], threads: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = threads.min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let work = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else { return done };
            done.push((i, f(item)));
        }
    };
    let mut all: Vec<(usize, R)> = std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads).map(|_| s.spawn(work)).collect();
        let mut all = work();
        for h in helpers {
            // a panic in `f` is a bug: pass it on
            all.extend(h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        }
        all
    });
    all.sort_unstable_by_key(|(i, _)| *i);
    all.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::map;

    #[test]
    fn results_in_input_order_whatever_the_threads() {
        let items: Vec<u64> = (0..1000).collect();
        let one = map(&items, 1, |x| x * x + 1);
        for t in [2, 3, 8] {
            assert_eq!(map(&items, t, |x| x * x + 1), one);
        }
        assert!(map(&[] as &[u64], 4, |x| *x).is_empty());
    }
}
