//! Plan/program validation (to be filled).
