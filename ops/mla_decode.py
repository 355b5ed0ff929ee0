"""unimem::mla_decode: split-K paged MLA decode attention over latent pages (issue 4)

Not implemented yet: this module is being written (see the issue)."""

__all__: list[str] = []
