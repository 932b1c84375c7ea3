"""Durable state: the pure task and effect models, and the stores that apply them atomically."""
