"""The validator: fetch, classify, score, rate, set weights, publish."""
