"""One op per module: Triton kernel, launcher, ``torch.library`` op (``fp8flow::<name>``) with a
fake implementation, and the torch reference that is its oracle and its CPU path."""
