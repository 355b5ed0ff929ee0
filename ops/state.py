"""unimem::state_gather and unimem::state_scatter: per-request state sections of arena slots (issue 5)

Not implemented yet: this module is being written (see the issue)."""

__all__: list[str] = []
