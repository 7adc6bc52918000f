"""`tessera sim`: a whole run on one machine — chain, storage, peers, adversaries, a validator."""
