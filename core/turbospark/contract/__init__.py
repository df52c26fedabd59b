"""The family contract: the hooks a family implements and the types they exchange.

It imports nothing of turbospark but ``errors`` and ``state``: the runtime
implements what the contract names (``protocols.py``), never the other way.
:data:`API_VERSION` versions it together with :mod:`turbospark.sdk`, the one
surface families import.
"""

API_VERSION = "1.4.0"
