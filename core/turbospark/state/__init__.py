"""Per-session state: the component protocols (``components.py``) and attention K/V (``kv.py``)."""
