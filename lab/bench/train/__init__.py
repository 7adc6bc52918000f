"""`tessera bench train`: strategies compared on the same tokens (see `lab.bench.train.cli`)."""
