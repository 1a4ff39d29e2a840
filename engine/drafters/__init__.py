"""Drafting: the `Drafter` protocol (base.py) and its implementations.

Kept import-light: the protocol module needs no drafter model, so the engine and the services can name the
protocol without loading what implements it.
"""
