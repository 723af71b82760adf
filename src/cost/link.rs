//! One link's alpha-beta model: bandwidth and per-message latency.

/// One link kind's alpha-beta parameters.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Bandwidth per rank and direction, bytes/s.
    pub bandwidth: f64,
    /// Per-message latency, seconds.
    pub latency: f64,
}

impl Link {
    /// Time to move `bytes` in `messages` messages.
    pub fn time(&self, bytes: f64, messages: f64) -> f64 {
        bytes / self.bandwidth + messages * self.latency
    }
}
