"""The live loop's parts, composed by `daemon.py`: checkpointing what was decided and done."""
