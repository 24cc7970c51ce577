"""What the supervisor knows of each inference engine, read from `config/engines/<engine>.toml`."""
