"""vllm-supervisor: halts systemd restart loops of LLM servers on deterministic crashes."""

__version__ = "0.1.0"
