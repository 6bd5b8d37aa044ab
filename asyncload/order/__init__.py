"""The order of an epoch: which source index comes at each position (samples or shards), and which positions were delivered."""
