"""Not imported: holds the `deepspeed` package that `crew run --as_deepspeed` puts on the ranks' path."""
