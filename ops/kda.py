"""unimem::kda_decode and unimem::kda_prefill: Kimi Delta Attention over slot states (issue 5)

Not implemented yet: this module is being written (see the issue)."""

__all__: list[str] = []
