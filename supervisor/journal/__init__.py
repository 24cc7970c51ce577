"""Reading the journal: the export-format parser and the journalctl follower."""
