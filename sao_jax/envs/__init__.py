"""Environments: where prompts come from and how replies are rewarded."""
