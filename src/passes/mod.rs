//! passes (to be filled).
