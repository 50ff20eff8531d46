"""The sidecar: `kvtier serve` (`server.py`), its HTTP API (`app.py`), wire format (`wire.py`),
OpenAPI schemas (`schemas.py`), auth (`auth.py`) and Prometheus metrics (`metrics.py`). The
clients are `kvtier.client`. No logic of its own beyond translation: the store decides."""
