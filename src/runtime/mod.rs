//! runtime (to be filled).
