"""unimem::mla_gather: paged latent rows -> [B, max_len, R + Dr] (issue 3)

Not implemented yet: this module is being written (see the issue)."""

__all__: list[str] = []
