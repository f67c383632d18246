"""The model side of extraction: swappable implementations behind one small interface."""
