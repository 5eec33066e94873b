"""Tests of vitconvert.distill (a package, so its conftest and helpers have unique module names)."""
