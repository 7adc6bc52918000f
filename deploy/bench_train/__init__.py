"""`tessera bench train`: strategies compared on the same tokens (see `deploy.bench_train.cli`)."""
