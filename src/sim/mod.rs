//! sim (to be filled).
