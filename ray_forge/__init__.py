"""ray_forge: TorchForge-style GRPO post-training on Ray, with vLLM policies and a TorchTitan trainer."""

__version__ = "0.1.0"
