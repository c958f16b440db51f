"""Hydra config groups, installed as the hybridrl.conf package so a non-editable install finds them."""
