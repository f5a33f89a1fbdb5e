"""`deepspeed.utils.tensor_fragment.fragment_address` as pickled in a checkpoint's optimizer files (stages 1-2,
param_slice_mappings): crew's stand-in, for tools that torch.load those files with weights_only=False."""

from crew.runtime.checkpoint.deepspeed_files import fragment_address

__all__ = ["fragment_address"]
