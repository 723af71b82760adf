//! ONNX importer (to be filled).
