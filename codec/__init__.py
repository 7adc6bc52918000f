"""Tensors to bytes and back: chunking, Top-k with error feedback, 2-bit values, index coder, wire format."""
