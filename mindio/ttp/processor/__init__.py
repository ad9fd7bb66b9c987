"""The rank side of mindio.ttp: the processor inside every training process, and the actions it runs."""
