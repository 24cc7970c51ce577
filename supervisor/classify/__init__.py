"""Classifying a crash: log lines, the signature table, fingerprints, the classifier and
the determinism model."""
