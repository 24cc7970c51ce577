"""Tracking: journal entries grouped into invocations of each unit, and how each ended."""
