"""Roofline analysis (issue 3): being written."""
