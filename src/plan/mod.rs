//! plan (to be filled).
