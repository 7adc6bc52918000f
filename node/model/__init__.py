"""The model: architecture, inner training loop, fingerprint and Hugging Face export."""
