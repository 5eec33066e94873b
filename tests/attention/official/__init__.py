"""Minimal, attributed copies of the official formulas each variant is checked against (tests only)."""
