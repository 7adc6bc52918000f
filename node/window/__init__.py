"""One window's exchange: roster and selection, publish and gather, consensus, history."""
