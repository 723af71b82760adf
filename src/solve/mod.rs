//! solve (to be filled).
