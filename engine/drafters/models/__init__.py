"""Drafter models: the shared base and TreeServe's layout (base.py), the distilled, EAGLE, EAGLE-3, published
EAGLE-1/2 and parallel drafters, loading by path (loading.py) and the file-only pair check (compatibility.py)."""
