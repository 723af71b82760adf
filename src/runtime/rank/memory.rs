//! A rank's memory measured from the tensors it holds: a counting CPU allocator
//! (csrc/memory_shim.cpp) gives the live bytes of CPU tensor storage and their peak inside a
//! window opened around each instruction; the instruction whose window peaks highest is split
//! into parts from the state the rank holds then. Not the process's resident memory: libtorch's
//! own buffers, Gloo's and the allocator's slack are not tensors.
//!
//! On a GPU the device's tensors are the CUDA caching allocator's, which this does not read
//! yet: there the measured parts are absent.

unsafe extern "C" {
    fn smp_memory_install();
    fn smp_memory_live() -> u64;
    fn smp_memory_window_open();
    fn smp_memory_window_peak() -> u64;
}

/// Makes the counting allocator libtorch's CPU allocator (once per process; tensors made before
/// are not counted).
pub fn install() {
    // SAFETY: no arguments; the shim installs a static allocator once.
    unsafe { smp_memory_install() }
}

/// Bytes of CPU tensor storage alive now.
pub fn live() -> u64 {
    // SAFETY: reads an atomic counter.
    unsafe { smp_memory_live() }
}

/// Opens a window whose peak starts at the live bytes now.
pub fn open_window() {
    // SAFETY: writes an atomic counter.
    unsafe { smp_memory_window_open() }
}

/// The most live bytes since the window opened.
pub fn window_peak() -> u64 {
    // SAFETY: reads atomic counters.
    unsafe { smp_memory_window_peak() }
}

/// Bytes of trained state: parameters (full tensors, ZeRO blocks), gradients, optimizer moments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// Parameters.
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
}

impl StateBytes {
    /// The sum of the three.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// A rank's memory at its peak, by part (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryParts {
    /// Parameters (ZeRO blocks and gathered stages included).
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer state (moments, fp32 master weights).
    pub optimizer: u64,
    /// Kept activations: what the peak holds beside every other part.
    pub activations: u64,
    /// Kept inputs offloaded to host memory.
    pub offloaded: u64,
    /// What the peak's instruction made and freed before it ended.
    pub temporaries: u64,
    /// Tensors held through the step that are none of the above (data batches, constants,
    /// buffers), measured at the step's start.
    pub other: u64,
    /// Everything on the device at the peak (all parts but `offloaded`).
    pub total: u64,
}

impl MemoryParts {
    /// The parts as an array, in field order.
    pub fn to_array(&self) -> [u64; 8] {
        [self.params, self.grads, self.optimizer, self.activations, self.offloaded, self.temporaries, self.other, self.total]
    }

    /// The parts from [`Self::to_array`]'s order.
    pub fn from_slice(c: &[u64]) -> MemoryParts {
        let at = |i: usize| c.get(i).copied().unwrap_or(0);
        MemoryParts { params: at(0), grads: at(1), optimizer: at(2), activations: at(3), offloaded: at(4), temporaries: at(5), other: at(6), total: at(7) }
    }
}

/// One instruction's window: live bytes before and after it, and its peak.
#[derive(Clone, Copy, Debug)]
pub struct Window {
    /// Live bytes when it opened.
    pub before: u64,
    /// Live bytes when it closed.
    pub after: u64,
    /// The most live bytes in between.
    pub peak: u64,
}

impl Window {
    /// Opens a window now.
    pub fn open() -> u64 {
        let before = live();
        open_window();
        before
    }

    /// Closes the window opened when `before` bytes were live.
    pub fn close(before: u64) -> Window {
        Window { before, after: live(), peak: window_peak() }
    }
}

/// The highest window of a run and its parts.
#[derive(Clone, Copy, Debug, Default)]
pub struct PeakTracker {
    /// Bytes held through the step that are no state (set at each step's start).
    pub other: u64,
    /// The parts at the highest window so far.
    pub peak: MemoryParts,
    /// Whether any window was seen.
    pub seen: bool,
}

impl PeakTracker {
    /// At a step's start: everything live but the state is `other`.
    pub fn start_step(&mut self, state: StateBytes, offloaded: u64) {
        self.other = live().saturating_sub(state.total() + offloaded);
    }

    /// Counts window `w`, with the offloaded bytes held when it closed and the state held when
    /// it opened and when it closed. The state at the peak itself is not read: it is taken from
    /// the end whose live bytes are nearer the peak (a backward peaks as it starts, before the
    /// gradients it makes; a forward as it ends).
    pub fn observe(&mut self, w: Window, offloaded: u64, (opened, closed): (StateBytes, StateBytes)) {
        let device = w.peak.saturating_sub(offloaded);
        if self.seen && device <= self.peak.total {
            return;
        }
        let state = if w.peak - w.before.min(w.peak) < w.peak - w.after.min(w.peak) { opened } else { closed };
        let temporaries = w.peak.saturating_sub(w.before.max(w.after));
        let held = state.total() + offloaded + temporaries + self.other;
        self.peak = MemoryParts {
            params: state.params,
            grads: state.grads,
            optimizer: state.optimizer,
            activations: w.peak.saturating_sub(held),
            offloaded,
            temporaries,
            other: self.other,
            total: device,
        };
        self.seen = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_window_is_split_into_its_parts() {
        let mut t = PeakTracker { other: 10, ..PeakTracker::default() };
        let state = StateBytes { params: 100, grads: 50, optimizer: 200 };
        // a forward: 360 live before, 400 after (40 kept), 430 at its peak (30 transient)
        t.observe(Window { before: 360, after: 400, peak: 430 }, 0, (state, state));
        let p = t.peak;
        assert_eq!((p.temporaries, p.activations, p.total), (30, 40, 430));
        assert_eq!(p.params + p.grads + p.optimizer + p.activations + p.temporaries + p.other, p.total);
        // a lower window leaves the peak where it was
        t.observe(Window { before: 360, after: 360, peak: 420 }, 0, (state, state));
        assert_eq!(t.peak, p);
        // offloaded bytes are host memory: not in the device total
        t.observe(Window { before: 400, after: 500, peak: 520 }, 100, (state, state));
        assert_eq!(t.peak, p, "420 bytes on the device do not pass 430");
        t.observe(Window { before: 400, after: 500, peak: 560 }, 100, (state, state));
        assert_eq!((t.peak.offloaded, t.peak.total, t.peak.activations, t.peak.temporaries), (100, 460, 40, 60));
        // a backward peaks near its start: the state is the one it opened with, not the
        // gradients it made by its end
        let made = StateBytes { grads: 150, ..state };
        let mut t = PeakTracker { other: 10, ..PeakTracker::default() };
        t.observe(Window { before: 500, after: 420, peak: 520 }, 0, (state, made));
        assert_eq!((t.peak.grads, t.peak.activations, t.peak.temporaries), (50, 140, 20));
        let mut t = PeakTracker { other: 10, ..PeakTracker::default() };
        t.observe(Window { before: 420, after: 500, peak: 520 }, 0, (state, made));
        assert_eq!((t.peak.grads, t.peak.activations, t.peak.temporaries), (150, 40, 20));
    }
}
