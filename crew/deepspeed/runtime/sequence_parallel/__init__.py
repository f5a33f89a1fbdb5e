"""`deepspeed.runtime.sequence_parallel`: Ulysses sequence parallelism (crew/runtime/ulysses)."""
