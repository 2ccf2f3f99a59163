"""Residency: which models are loaded, under a budget, and which request holds which."""
