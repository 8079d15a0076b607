"""Deliberately broken adapters: the suite must catch each, naming the requirement."""
