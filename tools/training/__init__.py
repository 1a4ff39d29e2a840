"""Offline training: self-distilled drafters and the C2T classifier."""
