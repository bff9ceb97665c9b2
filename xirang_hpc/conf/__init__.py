"""Hydra config groups (presets); schemas live in xirang_hpc.config.schema."""
