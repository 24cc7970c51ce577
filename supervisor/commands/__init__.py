"""The CLI commands, one module each: thin, built from the stages."""
