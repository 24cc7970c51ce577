"""Telling people about crashes: the Slack message and webhook, and the durable outbox."""

from __future__ import annotations
