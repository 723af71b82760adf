//! codegen (to be filled).
