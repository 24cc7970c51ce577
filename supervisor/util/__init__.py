"""Small helpers every stage may use: asyncio waits, private files, the retry rule."""
