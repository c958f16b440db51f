"""Importable pieces tests hand to the app by name (reward functions, ...)."""
