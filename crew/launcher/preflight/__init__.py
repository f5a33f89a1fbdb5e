"""Checks before a job: crew doctor, its node-side probe, and the merged preflight gate of crew run."""
