"""The peer: model, data, inner loop, publish, gather, aggregate, outer step, resume."""
