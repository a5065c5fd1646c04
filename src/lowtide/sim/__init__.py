"""The simulator: the production control loop on a virtual clock with fake ports."""
