"""The run's data: corpus, tokenizer, shards and the samples assigned to each (uid, window)."""
