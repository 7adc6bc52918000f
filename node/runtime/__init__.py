"""What a long-running node needs: arguments, chain clock, state files, logs, metrics, GPUs."""
