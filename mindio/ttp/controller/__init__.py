"""The controller side of mindio.ttp: one per job (rank 0, or node 0's mindio-run); its flows and decisions."""
