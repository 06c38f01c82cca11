"""Gradient rules, one small function per op type, grouped by family; registry.py tables them."""
