//! cost (to be filled).
