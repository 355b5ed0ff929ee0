"""unimem::causal_conv1d_update: short depthwise convolution updating the slot's conv state in place (issue 5)

Not implemented yet: this module is being written (see the issue)."""

__all__: list[str] = []
