"""What nodes agree on and how they reach each other: run config, windows, naming, stores, chains."""
