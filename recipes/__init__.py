"""Hydra search-path root of the `recipe/` config group (installed as hybridrl.recipes)."""
