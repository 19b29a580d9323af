"""Adapters that build a framework's model from the weight cache (each an optional extra)."""
