"""Environments. They follow ``ray_forge.core.env.TextEnv`` and never import Ray, vLLM or TorchTitan."""
