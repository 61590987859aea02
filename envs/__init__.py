"""Environments. They follow ``ray_forge.env.TextEnv`` and never import Ray, vLLM or TorchTitan."""
