"""`tessera doctor`: preflight checks of this machine, its chain and its bucket (`cli`), each a
row with a fix (`report`): machine (`machine`), chain (`chain`), bucket and link (`bucket`), and
training throughput against the run's windows (`throughput`)."""
