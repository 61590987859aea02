"""Coding and math environments whose rewards come from executing code."""
