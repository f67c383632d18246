"""Entry points: the `datagen` command line and the demo. Imports flow into here only."""
