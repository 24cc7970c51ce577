"""vllm-supervisor: halts systemd restart loops of LLM inference servers on deterministic crashes."""

__version__ = "0.1.0"
