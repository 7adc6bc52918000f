"""Operator tooling: the `tessera` command, simulation, doctor, provisioning."""
