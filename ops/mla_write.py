"""unimem::mla_kv_write and unimem::mla_kv_write_rmsnorm: the fused latent KV write (issue 3)

Not implemented yet: this module is being written (see the issue)."""

__all__: list[str] = []
