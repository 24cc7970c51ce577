"""Deciding what to do about an ended invocation: the policy, hung engines, port evidence."""
