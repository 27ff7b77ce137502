"""Adapters shipped with the project (see fastforward/model/adapters.py)."""
