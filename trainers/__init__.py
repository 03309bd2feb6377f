"""Drafter training (installed as `hf_diffspec.trainers`)."""
